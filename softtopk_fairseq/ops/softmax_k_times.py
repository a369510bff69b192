r"""The "softmax applied k times" relaxation of the sorted top-k (the paper's App. C baseline, after Goyal et
al. 2018 and Plotz & Roth 2018), with the same output layout as ``soft_topk(..., sorted=True)``.

Rank ``l`` is a softmax over the scores with the hard top-``l`` entries removed:

.. math::  A_{il} = \frac{\exp(x_i / T)\,[i \notin \mathrm{top}_l(x)]}{\sum_j \exp(x_j / T)\,[j \notin \mathrm{top}_l(x)]},
           \qquad l = 0, \dots, k-1,

so every rank column sums to 1, but unlike the OT operator the rows need not sum to at most 1 (an element can
be counted at several ranks). The removal set is hard (no gradient flows through which entries were
removed); the gradient flows through the softmaxes. ``-inf`` scores and ``mask == False`` entries get 0; NaN
and ``+inf`` scores are refused (``ops.BadScoresError``), as by the other relaxations.

With ``scaling="paper"`` the temperature ``T`` of a row is the one ``soft_topk(..., sorted=True,
scaling="paper")`` uses at the same ``epsilon`` (``epsilon * max_cost / 2``, see
:func:`~softtopk_fairseq.ops.effective_epsilon`), so the two relaxations can be compared at one setting.
"""
from typing import Optional

import torch
from torch import Tensor

from softtopk_fairseq import defaults
from softtopk_fairseq.ops.arguments import check_score_values, check_selection, compute_dtype, mask_along_last
from softtopk_fairseq.ops.backends import valid_entries
from softtopk_fairseq.ops.soft_topk import SCALINGS, divide_by_temperature, effective_epsilon


def softmax_k_times(scores: Tensor, k: int, *, dim: int = -1, epsilon: float = defaults.EPSILON,
                    mask: Optional[Tensor] = None, scaling: str = defaults.OPERATOR_SCALING) -> Tensor:
    """Sorted top-k relaxed by ``k`` successive softmaxes; output ``scores.shape + (k,)`` (ranks last,
    ``dim`` keeps its place), ``A[..., i, l]`` = soft indicator that element ``i`` has rank ``l``.

    ``epsilon`` is the temperature in the units of the scores (``scaling="none"``), or the normalised epsilon
    of the OT operator (``scaling="paper"``: the same per-row temperature as ``soft_topk``, differentiated like
    there). A row with fewer than ``l + 1`` valid entries gets an all-zero rank-``l`` column (like
    ``soft_topk``'s degenerate rows).
    """
    check_selection("softmax_k_times", scores, k, dim, "epsilon", epsilon, mask)
    if scaling not in SCALINGS:
        raise ValueError(f"softmax_k_times: scaling must be one of {SCALINGS}, got {scaling!r}")
    check_score_values("softmax_k_times", scores, mask=mask)
    dim = dim % scores.dim()
    x = scores.movedim(dim, -1)
    valid = valid_entries(x, None if mask is None else mask_along_last(mask, scores.shape, dim))
    compute = x.to(compute_dtype(x.dtype))
    T = effective_epsilon(compute, k, epsilon=epsilon, sorted=True, scaling=scaling, mask=valid)
    order = torch.topk(torch.where(valid, compute, -torch.inf).detach(), k, dim=-1)
    lowest = torch.finfo(compute.dtype).min
    left = valid.clone()  # the valid entries not among the hard top-rank yet
    cols = []
    for rank in range(k):
        # A softmax is unchanged by a shift of its row (at any T, so are its gradients): from the largest score
        # left, the (rank + 1)-th of the row, its logits are <= 0 -- a large score over a small T saturates
        # the softmax instead of overflowing to inf (NaN), and the runner-up keeps its distance. A distance
        # beyond the float range is clamped to it (-inf over an infinite T would be NaN); such an entry is out
        # of the softmax at any finite T anyway.
        largest_left = order.values[..., rank:rank + 1]
        shift = torch.where(largest_left > -torch.inf, largest_left, 0.0)
        logits = divide_by_temperature((compute - shift).clamp_min(lowest), T, left, check_errors=False)
        # A rank with no entry left (n_valid <= rank) is an all-zero column, not softmax(-inf...) = NaN.
        alive = left.any(-1, keepdim=True)
        safe = torch.where(alive, logits, torch.zeros_like(logits))
        cols.append(torch.where(left, torch.softmax(safe, -1), torch.zeros_like(safe)))
        left = left.scatter(-1, order.indices[..., rank:rank + 1], False)
    return torch.stack(cols, -1).to(scores.dtype).movedim(-2, dim)
