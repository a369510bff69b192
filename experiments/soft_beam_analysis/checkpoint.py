"""What the soft beam-search analyses share (a library, not a script): their command line (a checkpoint, its
data, the batch), the checkpoint's model and batches, one soft beam search on a batch, and a SOFT top-k
relaxation that records its calls.

The recording relaxation is public API, not a patch of the package: a subclass of
:class:`~softtopk_fairseq.modules.relaxations.OptimalTransport` passed to
``soft_beam_search(relaxation=...)``, which then relaxes every decoding step's top-k with it.
"""
import argparse
import contextlib
from typing import List, Optional, Tuple

import torch

import softtopk_fairseq.fairseq_plugin  # noqa: F401  (the plugin's architectures, to load its checkpoints)
from fairseq import checkpoint_utils
from softtopk_fairseq.modules.relaxations import OptimalTransport
from softtopk_fairseq.modules.soft_beam_search import soft_beam_search
from softtopk_fairseq.ops import soft_topk, use_backend


def checkpoint_arguments(description: str, max_tokens: int = 2000, candidates: bool = True):
    """A parser (``description``: the script's docstring, shown as written) with the checkpoint / data / batch options of the analyses: CHECKPOINT, DATA (its fairseq-preprocess
    folder), ``--subset``, ``--max-tokens`` and, with ``candidates``, ``--candidates`` (M, 50 by default)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("data")
    p.add_argument("--subset", default="valid")
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    if candidates:
        p.add_argument("--candidates", type=int, default=50, help="--soft-beam-candidates (0 = all k*V, exact)")
    return p


def load_model_and_task(a):
    """The checkpoint ``a.checkpoint``'s model (in train mode) and its task on ``a.data``, ``a.subset`` loaded."""
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([a.checkpoint], arg_overrides={"data": a.data})
    task.load_dataset(a.subset)
    return models[0], task


def batches(task, a, n: int) -> List[dict]:
    """The first ``n`` batches of ``a.subset`` at ``a.max_tokens`` tokens each, in the data's order."""
    it = task.get_batch_iterator(task.dataset(a.subset), max_tokens=a.max_tokens,
                                 required_batch_size_multiple=1).next_epoch_itr(shuffle=False)
    return [next(it) for _ in range(n)]


def load_model_and_batch(a):
    """The checkpoint's model (in train mode), its task, and the first batch of ``--subset``."""
    model, task = load_model_and_task(a)
    return model, task, batches(task, a, 1)[0]


def search(model, sample, dictionary, **options):
    """``soft_beam_search`` of ``model`` on ``sample`` (its source, and its target's length), ``options`` its
    keyword arguments (``beam``, ``relaxation``, ``epsilon``, ``scaling``, ``candidates``, ``bookkeeping``)."""
    ni = sample["net_input"]
    return soft_beam_search(model, ni["src_tokens"], ni["src_lengths"], sample["target"], pad=dictionary.pad(),
                            eos=dictionary.eos(), **options)


class RecordingSoftTopK(OptimalTransport):
    """The soft beam search's SOFT top-k (sorted, the search's solver options) that keeps each call's kept
    candidate scores and output in ``calls`` -- ``(kept, A)``, detached copies, one per decoding step -- and with
    ``backend`` solves on that backend (``"torch"``, ``"cpu"``, ``"triton"``; :func:`~softtopk_fairseq.ops.use_backend`)
    instead of the automatic choice."""

    def __init__(self, k: int, epsilon: float, scaling: str, *, backend: Optional[str] = None, **options):
        super().__init__(k, epsilon, scaling, **options)
        self.backend = backend
        self.calls: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def _relax(self, kept):
        with use_backend(self.backend) if self.backend else contextlib.nullcontext():
            relaxed = super()._relax(kept)
        self.calls.append((kept.detach().clone(), relaxed.A.detach().clone()))
        return relaxed

    def solve(self, kept, backend: str) -> torch.Tensor:
        """The sorted SOFT top-k of ``kept`` as this relaxation computes it, on ``backend``."""
        return soft_topk(kept, self.k, sorted=True, epsilon=self.epsilon, scaling=self.scaling, tol=self.tol,
                         max_iter=self.max_iter, backend=backend)
