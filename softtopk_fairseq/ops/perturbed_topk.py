r"""The perturbed top-k of Berthet et al., *Learning with Differentiable Perturbed Optimizers* (NeurIPS 2020):
the hard top-k smoothed by Gaussian noise on the scores, with a Monte-Carlo estimate of its Jacobian.

Definition
----------
For one row of scores :math:`x` (the valid entries), let :math:`y(x)` be the hard top-k: unsorted, the
indicator :math:`y_i = [x_i \text{ is among the } k \text{ largest}]` (sums to ``k``); sorted, the rank
assignment :math:`y_{il} = [x_i \text{ has rank } l]`, ``l < k`` (0 = largest). The perturbed top-k is

.. math::  y_\sigma(x) = \mathbb E_Z\,[\,y(x + \sigma Z)\,], \qquad Z \sim \mathcal N(0, I),

estimated with ``samples`` draws. Its Jacobian is :math:`\mathbb E[\,y(x + \sigma Z)\,Z^\top] / \sigma`
(Gaussian integration by parts), so the backward is the vector-Jacobian product

.. math::  \frac{\partial L}{\partial x} \approx \frac1{\sigma S}\sum_s \langle G, y(x + \sigma Z_s)\rangle\, Z_s,

with the same noise as the forward, or its control-variate form, which subtracts the estimate's own mean
:math:`\langle G, \hat y_\sigma\rangle` from each sample's inner product (still unbiased, since
:math:`\mathbb E[Z] = 0`, and of lower variance).

Relation to SOFT top-k: both are smoothed top-k's of the same linear program (the hard top-k maximises
:math:`\langle x, y\rangle` over the same polytope). SOFT top-k smooths it with an entropic regulariser --
a deterministic, exact solution with a closed-form gradient, smooth in ``epsilon``; the perturbed one smooths
it with Gaussian noise -- any top-k solver works, the samples are embarrassingly parallel, the gradient is an
unbiased estimate of the smoothed objective's, but noisy (its variance falls as 1/samples) and the forward
itself is a random estimate. Both tend to the hard top-k as ``epsilon``, ``sigma`` -> 0.

Noise: drawn from the caller's ``generator`` (or torch's default one) through a seed, which the backward uses
to draw the same noise again -- O(1) memory instead of ``samples`` x ``n`` saved values, reproducible under a
seeded generator. Masking and bad input follow ``soft_topk``: ``-inf`` scores (``+inf`` with
``largest=False``) and ``mask == False`` entries are excluded, get exactly 0 and zero gradient; rows with
``n_valid <= k`` get 1 on every valid entry (unsorted; gradient 0) or the perturbed sort of their valid
entries (sorted; gradient 0 where only one is valid); NaN or ``+inf`` scores (``ops.BadScoresError``), ``k``
outside ``1..n``, ``sigma <= 0`` and ``samples < 1`` raise. float16/bfloat16 are computed in float32 and
returned in their dtype. First derivatives only: differentiating the gradient (``create_graph=True``, then a
backward through it) raises rather than differentiate the estimate's noise.
"""
from typing import Optional

import torch
from torch import Tensor

from softtopk_fairseq import defaults
from softtopk_fairseq.ops.arguments import (check_flags, check_score_values, check_selection, compute_dtype,
                                            count_problems, mask_along_last)
from softtopk_fairseq.ops.soft_topk import first_order_only


def _hard_topk(z: Tensor, valid: Tensor, k: int, sorted: bool) -> Tensor:
    """y(z) for perturbed scores z (S, rows, n): indicator (S, rows, n) or rank one-hots (S, rows, n, k);
    invalid entries are never selected."""
    kk = min(k, z.shape[-1])
    zv = torch.where(valid, z, torch.full((), -torch.inf, dtype=z.dtype, device=z.device))
    idx = torch.topk(zv, kk, dim=-1).indices                          # (S, rows, kk), ranks in order
    picked = torch.gather(valid.expand_as(zv), -1, idx)               # rows with n_valid < k pick -inf ones
    if not sorted:
        return torch.zeros_like(z).scatter_(-1, idx, picked.to(z.dtype))
    y = z.new_zeros(*z.shape, k)
    # rank column l is one-hot at element idx[..., l] (when that element is valid)
    y[..., :kk].scatter_(-2, idx.unsqueeze(-2), picked.unsqueeze(-2).to(z.dtype))
    return y


def _noise(seed: int, shape, device, dtype) -> Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=dtype)


class _PerturbedTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, valid, k, sorted, sigma, samples, seed, control_variate):
        z = _noise(seed, (samples, *x.shape), x.device, x.dtype)
        out = _hard_topk(x.unsqueeze(0) + sigma * z, valid, k, sorted).mean(0)
        ctx.save_for_backward(x, valid, out)
        ctx.options = (k, sorted, sigma, samples, seed, control_variate)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, valid, out = ctx.saved_tensors
        k, sorted, sigma, samples, seed, control_variate = ctx.options
        z = _noise(seed, (samples, *x.shape), x.device, x.dtype)  # the forward's noise, drawn again
        y = _hard_topk(x.unsqueeze(0) + sigma * z, valid, k, sorted)
        dims = (-2, -1) if sorted else (-1,)
        inner = (y * grad_out.unsqueeze(0)).sum(dims)                # <G, y(x + sigma Z_s)>: (S, rows)
        if control_variate:
            inner = inner - (out * grad_out).sum(dims).unsqueeze(0)
        grad = (inner.unsqueeze(-1) * z).mean(0) / sigma
        n_valid = valid.sum(-1, keepdim=True)
        fixed = n_valid <= (1 if sorted else k)                      # a constant output: exactly 0
        grad = torch.where(valid & ~fixed, grad, torch.zeros_like(grad))
        grad, = first_order_only("perturbed_topk: no second derivatives (the backward is a Monte-Carlo estimate of "
                                 "the Jacobian, not differentiable again); use soft_topk with backend='torch' and "
                                 "scaling='none' for them", out, grad)
        return grad, None, None, None, None, None, None, None


def perturbed_topk(scores: Tensor, k: int, *, dim: int = -1, sigma: float = defaults.EPSILON,
                   samples: int = defaults.PERTURBED_SAMPLES,
                   sorted: bool = False, largest: bool = True, mask: Optional[Tensor] = None,
                   generator: Optional[torch.Generator] = None, control_variate: bool = True) -> Tensor:
    """Perturbed top-k (see the module docstring): ``E[top-k(x + sigma Z)]`` over ``samples`` Gaussian draws.

    Same layout as :func:`~softtopk_fairseq.ops.soft_topk`: unsorted output like ``scores`` (sums to ``k``
    along ``dim``), sorted output ``scores.shape + (k,)`` (rank ``l`` last). ``sigma`` is in the units of the
    scores; ``generator`` makes the noise reproducible; ``control_variate`` subtracts the estimate's mean
    from each sample in the backward (lower variance, still unbiased).
    """
    check_selection("perturbed_topk", scores, k, dim, "sigma", sigma, mask)
    check_flags("perturbed_topk", sorted=sorted, largest=largest, control_variate=control_variate)
    for problem in count_problems("samples", samples):
        raise ValueError(f"perturbed_topk: {problem}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"perturbed_topk: generator must be a torch.Generator or None, got {type(generator).__name__}")
    check_score_values("perturbed_topk", scores, largest, mask)
    dim = dim % scores.dim()
    n = scores.shape[dim]
    x = scores.to(compute_dtype(scores.dtype)).movedim(dim, -1)
    batch_shape = x.shape[:-1]
    x = x.reshape(-1, n)
    excluded = -torch.inf if largest else torch.inf
    valid = x != excluded
    if mask is not None:
        valid = valid & mask_along_last(mask, scores.shape, dim).reshape(-1, n)
    if not largest:
        x = -x
    x = torch.where(valid, x, torch.zeros_like(x))  # excluded entries: finite, never selected
    seed = int(torch.randint(0, 2**62, (1,), generator=generator,
                             device=generator.device if generator is not None else "cpu").item())
    out = _PerturbedTopK.apply(x, valid, k, sorted, float(sigma), samples, seed, control_variate)
    if sorted:
        out = out.reshape(*batch_shape, n, k).movedim(-2, dim)
    else:
        out = out.reshape(*batch_shape, n).movedim(-1, dim)
    return out.to(scores.dtype)
