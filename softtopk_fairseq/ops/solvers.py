r"""Solvers for the entropic OT problem behind SOFT top-k, in normalised units (torch only).

Both operators are one problem with different anchors. Row ``r`` holds scores already divided by the
temperature, :math:`u_i = x_i/\varepsilon`, a validity mask, anchors :math:`y_0 > y_1 > \dots > y_{m-1}`
spaced by 1 and a target mass :math:`c_l` per anchor. With the cost :math:`C_{il} = \tfrac12 (x_i - y_l)^2`
the entropic plan, scaled so every valid element carries mass 1, is

.. math::  P_{il} = \operatorname{softmax}_l\,(u_i y_l + h_l), \qquad \textstyle\sum_i P_{il} = c_l,

because :math:`-C_{il}/\varepsilon = u_i y_l - \tfrac{y_l^2}{2\varepsilon} - \tfrac{x_i^2}{2\varepsilon}`: the
last term cancels in the softmax over ``l`` and the middle one is absorbed in the anchor potential
:math:`h_l`. One potential is redundant; we pin it to 0 (the last active anchor).

* SOFT top-k: anchors ``y = (1, 0)``, targets ``(k, n - k)``: :math:`A_i = P_{i0} = \sigma(u_i - \tau)`.
* sorted SOFT top-k: anchors ``y_l = k - l`` (l = 0..k), targets ``(1, ..., 1, n - k)``: column ``l`` of
  ``P`` marks rank ``l`` (0 = largest), the last one collects the other ``n - k`` elements.

(The code shifts both anchor sets to be centred on 0, which leaves ``P`` unchanged.)

Rows with ``n_valid <= k`` keep only the first ``n_valid`` anchors (unit targets, the rest anchor and the
unreachable ranks get 0 mass): a soft sort of the valid elements, or all ones for the unsorted operator.
All-masked rows give zeros.

:func:`newton_semi_dual` maximises the semi-dual :math:`F(h) = \sum_l c_l h_l - \sum_i
\operatorname{logsumexp}_l(u_i y_l + h_l)` whose gradient is :math:`c - P^\top \mathbf 1` and whose negative
Hessian is :math:`M = \operatorname{diag}(P^\top \mathbf 1) - P^\top P` -- at the optimum, ``n`` times the
paper's :math:`\mathcal K` (App. H). :func:`sinkhorn` is the paper's Algorithm 1 in the log domain, kept as a
reference. Both return the plan ``P`` (rows, n, m) and per-row ``(iterations, marginal error)``.
"""
from typing import Optional, Tuple

import torch

Tensor = torch.Tensor


def anchor_targets(n_valid: Tensor, k: int, sorted: bool, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """Anchors ``y`` (m,) and per-row target masses ``c`` (rows, m); an anchor with ``c == 0`` is inactive.

    The anchors are centred on 0 (the plan is invariant to shifting them, u_i * shift being constant
    across anchors) to keep the logits small in float32.
    """
    device = n_valid.device
    nv = n_valid.to(dtype).unsqueeze(-1)
    if sorted:
        m = k + 1
        y = torch.arange(k, -1, -1, device=device, dtype=dtype) - k / 2
        ranks = torch.arange(k, device=device, dtype=dtype)
        c_rank = (ranks < nv).to(dtype)                        # rank l is reachable iff l < n_valid
        c_rest = (nv - k).clamp_min(0)
        c = torch.cat([c_rank, c_rest], dim=-1)
    else:
        m = 2
        y = torch.tensor([0.5, -0.5], device=device, dtype=dtype)
        c = torch.cat([nv.clamp_max(k), (nv - k).clamp_min(0)], dim=-1)
    assert c.shape[-1] == m
    return y, c


def _plan(u: Tensor, valid: Tensor, y: Tensor, h: Tensor) -> Tensor:
    """P (rows, n, m): softmax over anchors of u_i y_l + h_l; zero rows for masked elements."""
    logits = u.unsqueeze(-1) * y + h.unsqueeze(-2)
    p = torch.softmax(logits, dim=-1)
    return torch.where(valid.unsqueeze(-1), p, torch.zeros((), dtype=p.dtype, device=p.device))


def _marginal_error(s: Tensor, c: Tensor) -> Tensor:
    """Per-row max relative error of the anchor masses over active anchors."""
    active = c > 0
    err = torch.where(active, (s - c).abs() / c.clamp_min(1), torch.zeros_like(s))
    return err.amax(dim=-1)


def pinned_anchor(c: Tensor) -> Tensor:
    """Index of the last active anchor per row (its potential is fixed to 0); 0 for empty rows."""
    m = c.shape[-1]
    idx = torch.arange(m, device=c.device).expand_as(c)
    return torch.where(c > 0, idx, torch.zeros_like(idx)).amax(dim=-1)


def free_anchors(c: Tensor) -> Tensor:
    """Bool (rows, m): active anchors whose potential is a variable (all active but the pinned one)."""
    m = c.shape[-1]
    pinned = torch.nn.functional.one_hot(pinned_anchor(c), m).bool()
    return (c > 0) & ~pinned


def hessian_solve(p: Tensor, s: Tensor, free: Tensor, rhs: Tensor) -> Tensor:
    r"""Solve :math:`M w = \text{rhs}` on the free anchors, :math:`M = \operatorname{diag}(s) - P^\top P`.

    ``w`` is 0 on the other anchors. A relative ridge of ``eps(dtype)`` keeps saturated rows (where
    ``M`` -> 0 together with the right-hand side) finite.
    """
    ptp = p.transpose(-1, -2) @ p
    mat = torch.diag_embed(s) - ptp
    f = free.to(p.dtype)
    both = f.unsqueeze(-1) * f.unsqueeze(-2)
    eye = torch.eye(mat.shape[-1], dtype=p.dtype, device=p.device)
    scale = (s * f).amax(dim=-1, keepdim=True).clamp_min(1).unsqueeze(-1)
    ridge = torch.finfo(p.dtype).eps * scale
    mat = mat * both + eye * (1 - f).unsqueeze(-1) + ridge * eye * f.unsqueeze(-1)
    return torch.linalg.solve(mat, (rhs * f).unsqueeze(-1)).squeeze(-1) * f


def initial_potentials(u: Tensor, valid: Tensor, c: Tensor, y: Tensor) -> Tensor:
    """Potentials of the hard assignment: the boundary between consecutive active anchors ``l`` and
    ``l + 1`` sits halfway between the last element that anchor ``l`` should hold and the next one."""
    rows, n = u.shape
    m = c.shape[-1]
    cum = torch.cumsum(c, dim=-1).round().long()                  # elements held by anchors 0..l
    held_before_last = int(c[:, :-1].sum(-1).max().round().item()) if rows else 0
    kk = max(1, min(n, held_before_last + 1))
    top = torch.topk(torch.where(valid, u, torch.full_like(u, -torch.inf)), kk, dim=-1).values
    idx_hi = (cum[:, :-1] - 1).clamp(0, kk - 1)
    idx_lo = cum[:, :-1].clamp(0, kk - 1)
    boundary = 0.5 * (top.gather(-1, idx_hi) + top.gather(-1, idx_lo))
    boundary = torch.nan_to_num(boundary, nan=0.0, posinf=0.0, neginf=0.0)
    gap = (y[:-1] - y[1:])                                         # anchor spacing (1 here)
    # h_{l+1} - h_l = boundary_l * gap_l; summed from the pinned (last active) anchor down.
    diffs = boundary * gap
    active_pair = (c[:, 1:] > 0)
    diffs = torch.where(active_pair, diffs, torch.zeros_like(diffs))
    # h_l = -sum_{j >= l} diffs_j, so that h of the last active anchor is 0.
    h = torch.cat([-torch.flip(torch.cumsum(torch.flip(diffs, [-1]), -1), [-1]), torch.zeros_like(c[:, :1])], -1)
    return torch.where(c > 0, h, torch.full_like(h, -torch.inf))


def newton_semi_dual(u: Tensor, valid: Tensor, y: Tensor, c: Tensor, tol: float, max_iter: int,
                     max_halvings: int = 30) -> Tuple[Tensor, Tensor]:
    """Damped Newton on the semi-dual. Returns ``(P, info)``, info = (rows, 2): iterations, error.

    A step is accepted when it lowers the marginal error (not the objective: in float32 the objective's
    change near the optimum falls below its resolution and an Armijo test would stall); otherwise it is
    halved. Rows stop individually once their error is at most ``tol``.
    """
    rows = u.shape[0]
    h = initial_potentials(u, valid, c, y)
    free = free_anchors(c)
    p = _plan(u, valid, y, h)
    s = p.sum(dim=-2)
    err = _marginal_error(s, c)
    iters = torch.zeros(rows, dtype=u.dtype, device=u.device)
    done = err <= tol
    for _ in range(max_iter):
        if bool(done.all()):
            break
        step = hessian_solve(p, s, free, c - s)
        alpha = torch.ones(rows, 1, dtype=u.dtype, device=u.device)
        accepted = done
        new_h, new_p, new_s, new_err = h, p, s, err
        for _ in range(max_halvings):
            trial_h = torch.where(free, h + alpha * step, h)
            trial_p = _plan(u, valid, y, trial_h)
            trial_s = trial_p.sum(dim=-2)
            trial_err = _marginal_error(trial_s, c)
            ok = ~accepted & ((trial_err < err) | (trial_err <= tol))
            new_h = torch.where(ok.unsqueeze(-1), trial_h, new_h)
            new_p = torch.where(ok.view(-1, 1, 1), trial_p, new_p)
            new_s = torch.where(ok.unsqueeze(-1), trial_s, new_s)
            new_err = torch.where(ok, trial_err, new_err)
            accepted = accepted | ok
            if bool(accepted.all()):
                break
            alpha = torch.where(accepted.unsqueeze(-1), alpha, alpha * 0.5)
        iters = iters + (~done).to(u.dtype)
        h, p, s, err = new_h, new_p, new_s, new_err
        # A row whose every halved step failed has reached its rounding floor: stop it there.
        done = done | (err <= tol) | ~accepted
    return p, torch.stack([iters, err], dim=-1)


def sinkhorn(u: Tensor, valid: Tensor, y: Tensor, c: Tensor, max_iter: int,
             tol: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    r"""Log-domain Sinkhorn (the paper's Algorithm 1, stabilised) on the same problem.

    Alternates :math:`a_i = -\operatorname{logsumexp}_l(u_i y_l + b_l)` (rows hold mass 1) and
    :math:`b_l = \log c_l - \operatorname{logsumexp}_i(u_i y_l + a_i)` (anchors hold :math:`c_l`), for
    ``max_iter`` iterations, or until the anchor masses are within ``tol`` when it is given.
    """
    neg_inf = torch.full((), -torch.inf, dtype=u.dtype, device=u.device)
    # Masked elements are excluded through a_i = -inf; their kernel stays finite so that autograd through
    # this loop (used as a reference in tests) never sees a logsumexp over -inf only.
    kernel = torch.where(valid, u, torch.zeros_like(u)).unsqueeze(-1) * y          # (rows, n, m)
    log_c = torch.where(c > 0, torch.log(c.clamp_min(1e-300)), neg_inf)
    b = torch.where(c > 0, torch.zeros_like(c), neg_inf)
    rows = u.shape[0]
    iters = torch.zeros(rows, dtype=u.dtype, device=u.device)
    has_anchor = (c > 0).any(-1)
    for it in range(max_iter):
        a = -torch.logsumexp(kernel + b.unsqueeze(-2), dim=-1)
        a = torch.where(valid & has_anchor.unsqueeze(-1), a, neg_inf)
        col = torch.logsumexp(kernel + a.unsqueeze(-1), dim=-2)
        b = torch.where(c > 0, log_c - col, neg_inf)
        iters += 1
        if tol is not None:
            p = _plan(u, valid & has_anchor.unsqueeze(-1), y, b)
            if bool((_marginal_error(p.sum(-2), c) <= tol).all()):
                break
    p = _plan(u, valid & has_anchor.unsqueeze(-1), y, b)
    p = torch.nan_to_num(p, nan=0.0)
    return p, torch.stack([iters, _marginal_error(p.sum(-2), c)], dim=-1)
