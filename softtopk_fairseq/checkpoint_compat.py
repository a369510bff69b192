"""Let torch >= 2.6 load fairseq checkpoints.

Since torch 2.6, ``torch.load`` defaults to ``weights_only=True``, which refuses any pickled class that is
not allow-listed. fairseq checkpoints store the training arguments as an ``argparse.Namespace``, so
``fairseq-generate`` and a resumed ``fairseq-train`` fail with an ``UnpicklingError``. They can also hold numpy
arrays: with ``--eval-bleu`` the saved meters keep sacrebleu's n-gram counts as int64 arrays, so
``checkpoint_best.pt`` of such a run is refused too. fairseq imports ``--user-dir`` before it loads a
checkpoint, so allow-listing these classes on plugin import fixes all of them.
"""
import _codecs
import argparse
import importlib
from typing import List

import torch


# The module that pickles name for numpy's array reconstruction: numpy._core under numpy 2, numpy.core under numpy 1
# (numpy 1.26's numpy._core is a stub without multiarray; numpy 2's numpy.core warns on use).
_MULTIARRAY = {2: "numpy._core.multiarray", 1: "numpy.core.multiarray"}


def _numpy_array_globals() -> List[object]:
    """What unpickling a plain numpy array or scalar needs (no arbitrary code: array reconstruction and the
    built-in dtypes) -- under the other numpy major version's names too where torch takes a name with the object
    (torch >= 2.6), so that a checkpoint written under numpy 1 loads under numpy 2 and the other way round."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - fairseq requires numpy
        return []
    running = 2 if int(np.__version__.split(".")[0]) >= 2 else 1
    multiarray = importlib.import_module(_MULTIARRAY[running])
    dtypes = [type(np.dtype(t)) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8,
                                          np.float16, np.float32, np.float64)]
    # (_codecs.encode: how a numpy scalar's bytes are pickled, a str to bytes; torch >= 2.5 allows it itself)
    allowed = [multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype, *dtypes, _codecs.encode]
    if _torch_version() >= (2, 6):
        other = _MULTIARRAY[3 - running]
        allowed += [(multiarray._reconstruct, f"{other}._reconstruct"), (multiarray.scalar, f"{other}.scalar")]
    return allowed


def _torch_version():
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def allow_fairseq_checkpoints() -> None:
    """Allow-list ``argparse.Namespace`` and numpy arrays for ``torch.load(weights_only=True)`` (no-op on old
    torch)."""
    add_safe_globals = getattr(torch.serialization, "add_safe_globals", None)
    if add_safe_globals is not None:
        add_safe_globals([argparse.Namespace, *_numpy_array_globals()])
