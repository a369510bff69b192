"""Let torch >= 2.6 load fairseq checkpoints.

Since torch 2.6, ``torch.load`` defaults to ``weights_only=True``, which refuses any pickled class that is
not allow-listed. fairseq checkpoints store the training arguments as an ``argparse.Namespace``, so
``fairseq-generate`` and a resumed ``fairseq-train`` fail with an ``UnpicklingError``. fairseq imports
``--user-dir`` before it loads a checkpoint, so allow-listing the class on plugin import fixes both.
"""
import argparse

import torch


def allow_fairseq_checkpoints() -> None:
    """Allow-list ``argparse.Namespace`` for ``torch.load(weights_only=True)`` (no-op on old torch)."""
    add_safe_globals = getattr(torch.serialization, "add_safe_globals", None)
    if add_safe_globals is not None:
        add_safe_globals([argparse.Namespace])
