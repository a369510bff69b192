r"""Closed-form implicit backward of SOFT top-k (the paper's Theorem 3 / Algorithm 4), O(n m) per row.

In the normalised units of :mod:`softtopk_fairseq.ops.solvers` (``u = x / eps``, plan
:math:`P_{il} = \operatorname{softmax}_l(u_i y_l + h_l)`, potentials ``h(u)`` defined implicitly by the
anchor masses :math:`\sum_i P_{il} = c_l`, one of them pinned), let :math:`G_{il} = \partial L/\partial
P_{il}` (0 on columns that are not returned). Differentiating the softmax and the constraint gives

.. math::

    \frac{\partial L}{\partial x_i} = \frac1\varepsilon \sum_l P_{il}\,(y_l - \bar y_i)\,(G_{il} - w_l),
    \qquad \bar y_i = \sum_l P_{il} y_l,

where ``w`` solves :math:`M w = v` on the free anchors (``w = 0`` elsewhere) with
:math:`M = \operatorname{diag}(P^\top\mathbf 1) - P^\top P` -- the paper's :math:`n\,\mathcal K` -- and
:math:`v_l = \sum_i P_{il}(G_{il} - \bar G_i)`, :math:`\bar G_i = \sum_l P_{il} G_{il}`. Derivation: the
softmax gives :math:`dL = \sum_{il} P_{il}(G_{il} - \bar G_i)\,dz_{il}` with
:math:`dz_{il} = y_l\,du_i + dh_l`; the constraint gives :math:`M\,dh = -B^\top du`,
:math:`B_{il} = P_{il}(y_l - \bar y_i)`; substitute.

Masked elements have :math:`P_{i\cdot} = 0` and so get exactly zero gradient. Nothing from the forward
iterations is needed: only the plan, which is rebuilt from the operator's output.
"""
import torch

from softtopk_fairseq.ops.solvers import free_anchors, hessian_solve

Tensor = torch.Tensor


def implicit_grad(taken: Tensor, rest: Tensor, grad_taken: Tensor, y: Tensor, c: Tensor) -> Tensor:
    """dL/du (rows, n) for the sorted plan given as its rank columns ``taken`` (rows, k, n) and its rest
    column ``rest`` (rows, n); ``grad_taken`` = dL/dP on the rank columns (the rest column is not returned,
    so its gradient is 0).

    The rest anchor is never free (it is the pinned anchor, or inactive in rows with ``n_valid <= k``), so
    ``w`` and the Hessian live on the ranks only, and every O(nk) step is a contraction over the ranks:
    ``grad_i = sum_l P G y - ybar Gbar - sum_l P y w + ybar sum_l P w``.
    """
    rows, k, n = taken.shape
    y_rank, y_rest = y[:k], y[k]
    pg = taken * grad_taken
    ones_y = torch.stack([torch.ones_like(y_rank), y_rank]).expand(rows, 2, k)
    g_bar, yg = (ones_y @ pg).unbind(-2)                               # (rows, n) each
    v = pg.sum(-1) - (taken @ g_bar.unsqueeze(-1)).squeeze(-1)          # (rows, k)
    w = hessian_solve(taken, taken.sum(-1), free_anchors(c)[:, :k], v)  # (rows, k)
    coeffs = torch.stack([y_rank.expand(rows, k), w * y_rank, w], dim=-2)
    y_bar, yw, pw = (coeffs @ taken).unbind(-2)
    y_bar = y_bar + y_rest * rest
    return yg - y_bar * g_bar - yw + y_bar * pw


def sigmoid_grad(a: Tensor, grad_a: Tensor, valid: Tensor) -> Tensor:
    r"""dL/du for the unsorted operator :math:`A_i = \sigma(u_i - \tau)`, :math:`\sum_i A_i = k`.

    The general formula above with two anchors: with :math:`a_i = A_i(1 - A_i)`,

    .. math::  \frac{\partial L}{\partial u_i} = a_i \Big(G_i - \frac{\sum_j G_j a_j}{\sum_j a_j}\Big)

    (the second term is :math:`d\tau/du`'s contribution). Rows whose entries are all saturated have
    :math:`\sum_j a_j = 0` and a zero gradient; masked entries have :math:`a_i = 0`.
    """
    w = torch.where(valid, a * (1 - a), torch.zeros_like(a))
    mean_g = (grad_a * w).sum(-1, keepdim=True) / w.sum(-1, keepdim=True).clamp_min(torch.finfo(a.dtype).tiny)
    return w * (grad_a - mean_g)


def temperature_grad(grad_x: Tensor, x: Tensor, valid: Tensor, eps: Tensor) -> Tensor:
    """dL/deps (rows,) from dL/dx: the output depends on x / eps only, so dL/deps = -sum_i dL/dx_i x_i / eps
    (any shift of x cancels, since sum_i dL/dx_i = 0; subtracting the row mean keeps it accurate)."""
    if bool(valid.all()):  # the common case, in three passes
        xc = x - x.mean(-1, keepdim=True)
    else:
        xc = torch.where(valid, x, torch.zeros_like(x))
        xc = xc - xc.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp_min(1)
        xc = torch.where(valid, xc, torch.zeros_like(xc))
    return -torch.linalg.vecdot(grad_x, xc) / eps


def paper_temperature_grad(grad_eps: Tensor, slope: Tensor) -> Tensor:
    """dL/dx (rows,) at the entry where the paper scaling's maximal cost sits: ``dL/deps * d eps / d x``. Where
    ``eps = epsilon * M / 2`` overflowed to ``inf`` its slope may too, while ``dL/deps`` is 0 there (the output
    no longer moves with it): the slope is clamped to the float range so that ``0 * inf`` is 0, not NaN."""
    largest = torch.finfo(slope.dtype).max
    return grad_eps * slope.clamp(-largest, largest)
