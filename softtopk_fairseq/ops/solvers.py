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
reference. Both return the plan ``P`` and per-row ``(iterations, marginal error)``.

Plans are stored anchors-first, ``P[r, l, i]`` of shape (rows, m, n): the softmax over the few anchors then
runs across contiguous slices (far faster on CPU than over a last dimension of size k+1).
"""
import math
from typing import NamedTuple, Optional, Tuple

import torch

Tensor = torch.Tensor

# exp(-SATURATION) is below float64 resolution relative to 1: an element that far (in units of eps)
# past a boundary sits entirely on one side of it.
SATURATION = 40.0
# Largest change of an anchor potential in one Newton step (see newton_semi_dual).
MAX_STEP = 2.0
# Marginal error below which a row that two halved steps cannot improve is taken as converged as far as
# its floating-point precision allows.
NEAR_FLOOR = 1e-4
# Up to this |u| (scores within 16 eps of the k-th largest) the plan's logits are formed directly.
DIRECT_LOGITS_MAX_U = 16.0
# Largest logit difference between consecutive anchors kept as is (see _plan): exp(-64) ~ 1.6e-28.
LOGIT_CLAMP = 64.0
# Plan entries at or below this (twice the clamp's floor exp(-LOGIT_CLAMP), for rounding) are taken as 0 by the
# sorted backwards: the clamped forward does not move them, while the closed form would weigh them by 1 / eps --
# a gradient of order 1e-28 / eps where the forward is flat (320 at eps = 1e-30). Elsewhere it changes the
# gradient by less than 1e-27 / eps.
PLAN_FLOOR = 2.0 * math.exp(-LOGIT_CLAMP)
# Halvings of a damped Newton step tried before the row stops (see newton_semi_dual).
MAX_HALVINGS = 8
# Marginal error of the hard-assignment start above which the log-c shifted start is tried too.
SECOND_START_ERROR = 0.05
# Ridge added to the Newton system, in units of the dtype's machine epsilon times the largest anchor mass.
RIDGE_ULPS = 16.0

# The unsorted root steps in log space -- Newton on log(sum_i A_i) - log k -- when k is at most this fraction
# of the row's valid elements: there tau sits in the sigmoids' upper tail, where the sum is nearly exponential
# in tau and plain Newton creeps (5.7 steps on average at 64x1000, k 5, paper scaling, against 2.3); nearer the
# middle the sum is nearly linear and plain Newton is better. (Not mirrored for k near n: there the complement
# n - sum_i A_i would be needed to full precision, which the float32 kernels do not form.)
LOG_STEP_FRACTION = 0.25

# The solver constants the fused kernels share with this file: handed to the Triton kernels as constexpr
# arguments and to the C kernels as -D flags (cpu_kernels.py), so that each is written once, here.
KERNEL_CONSTANTS = {"LOGIT_CLAMP": LOGIT_CLAMP, "MAX_STEP": MAX_STEP, "NEAR_FLOOR": NEAR_FLOOR,
                    "SECOND_START_ERROR": SECOND_START_ERROR, "RIDGE_ULPS": RIDGE_ULPS}
# ... those of the sorted backward's kernels ...
BACKWARD_KERNEL_CONSTANTS = {"RIDGE_ULPS": RIDGE_ULPS, "PLAN_FLOOR": PLAN_FLOOR}
# ... and those of the unsorted root's kernels.
UNSORTED_KERNEL_CONSTANTS = {"LOG_STEP_FRACTION": LOG_STEP_FRACTION}


def normalise_scores(x: Tensor, centre: Tensor, eps: Tensor, bound: float) -> Tensor:
    """The normalised scores u = (x - centre) / eps of (rows, n) scores, per-row ``centre`` and ``eps``
    (rows,), clamped to +-bound. (The fused kernels compute the same, bit for bit, as they stream x.)

    Centring at the selection boundary (the k-th largest score, not the maximum) keeps the logits
    u_i y_l + h_l of the elements that matter -- those near the boundary -- small, so float32 does not lose
    them to cancellation. The clamp keeps far-away elements (saturated anyway) from overflowing.
    """
    return ((x - centre.unsqueeze(-1)) / eps.unsqueeze(-1)).clamp(-bound, bound)


def centred_anchors(m: int, dtype: torch.dtype, device) -> Tensor:
    """Anchors ``m-1, ..., 1, 0`` one unit apart, shifted to be centred on 0 (the plan is invariant to the
    shift, u_i * shift being constant across anchors; centring keeps the logits small in float32)."""
    return torch.arange(m - 1, -1, -1, dtype=dtype, device=device) - (m - 1) / 2


def log_mass_shift(c: Tensor) -> Tensor:
    """Threshold shift (rows, m-1) that multiplies each anchor's weight by its target mass: adding
    ``log c_{l+1} - log c_l`` to ``t_l`` adds ``log c_l`` to ``h_l``; 0 where anchor ``l+1`` is inactive."""
    log_c = torch.log(c.clamp_min(torch.finfo(c.dtype).tiny))
    return torch.where(c[:, 1:] > 0, log_c[:, 1:] - log_c[:, :-1], torch.zeros_like(c[:, 1:]))


def anchor_targets(n_valid: Tensor, k: int, sorted: bool, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """Anchors ``y`` (m,) and per-row target masses ``c`` (rows, m); an anchor with ``c == 0`` is inactive.

    The anchors are :func:`centred_anchors`.
    """
    device = n_valid.device
    nv = n_valid.to(dtype).unsqueeze(-1)
    if sorted:
        ranks = torch.arange(k, device=device, dtype=dtype)
        c_rank = (ranks < nv).to(dtype)                        # rank l is reachable iff l < n_valid
        c = torch.cat([c_rank, (nv - k).clamp_min(0)], dim=-1)
    else:
        c = torch.cat([nv.clamp_max(k), (nv - k).clamp_min(0)], dim=-1)
    return centred_anchors(c.shape[-1], dtype, device), c


def _logits(u: Tensor, t: Tensor) -> Tensor:
    """Logits z (rows, m, n) of the plan for thresholds ``t`` (rows, m-1), ``t_l = h_{l+1} - h_l``.

    Consecutive anchors are one unit apart, so ``z_{i,l+1} - z_{il} = t_l - u_i``. When every ``|u_i|`` is
    small the direct form ``u_i y_l + h_l`` is exact enough and a single fused op. Otherwise the logits are
    running sums of the differences ``t_l - u_i``: forming ``u_i y_l + h_l`` would cancel catastrophically
    once ``|u|`` is large (scores far apart in units of eps), while ``t_l - u_i`` is exact for the elements
    near a threshold -- the ones that matter. Each difference is clamped to +-LOGIT_CLAMP: beyond that an
    anchor is saturated (weight < 2e-28 relative to its neighbour, below float64 resolution) and a huge
    term would wipe out the small ones after it in the running sum. ``t_l = -inf`` switches anchor
    ``l + 1`` (and every later one) off.
    """
    rows, n = u.shape
    m = t.shape[-1] + 1
    off = torch.isneginf(t)
    direct = u.numel() > 0 and not u.requires_grad and bool(u.abs().amax() <= DIRECT_LOGITS_MAX_U)
    if direct:
        y = centred_anchors(m, u.dtype, u.device)
        # h_l = -sum_{j >= l} t_j (the last active anchor pinned at 0); -inf after the first -inf threshold.
        tf = torch.where(off, torch.zeros_like(t), t)
        h = torch.cat([-torch.flip(torch.cumsum(torch.flip(tf, [-1]), -1), [-1]), t.new_zeros(rows, 1)], -1)
        active = torch.cat([torch.ones_like(off[:, :1]), ~off], -1)
        h = torch.where(active, h, torch.full_like(h, -torch.inf))
        # mul + add_ rather than addcmul: the ternary broadcasting kernel is several times slower on CPU.
        return (u.unsqueeze(-2) * y.view(1, m, 1)).add_(h.unsqueeze(-1))
    diffs = (t.unsqueeze(-1) - u.unsqueeze(-2)).clamp_(-LOGIT_CLAMP, LOGIT_CLAMP)  # (rows, m-1, n)
    if bool(off.any()):
        diffs.masked_fill_(off.unsqueeze(-1), -torch.inf)
    if diffs.requires_grad:  # the unrolled-Sinkhorn reference differentiates through this
        return torch.cat([u.new_zeros(rows, 1, n), torch.cumsum(diffs, dim=-2)], dim=-2)
    logits = u.new_zeros(rows, m, n)  # anchor 0 has logit 0: the running sums go after it, no copy
    torch.cumsum(diffs, dim=-2, out=logits[:, 1:])
    return logits


def _plan(u: Tensor, valid: Optional[Tensor], t: Tensor) -> Tensor:
    """P (rows, m, n) for thresholds ``t``; zero columns for masked elements (``valid=None``: none)."""
    p = torch.softmax(_logits(u, t), dim=-2)
    if valid is None:
        return p
    return torch.where(valid.unsqueeze(-2), p, torch.zeros((), dtype=p.dtype, device=p.device))


def _marginal_error(s: Tensor, c: Tensor) -> Tensor:
    """Per-row max relative error of the anchor masses over active anchors."""
    active = c > 0
    err = torch.where(active, (s - c).abs() / c.clamp_min(1), torch.zeros_like(s))
    return err.amax(dim=-1)


def _pick(rows: Tensor, new: Tensor, old: Tensor) -> Tensor:
    """Per-row choice between two tensors whose first dimension is the row; no copy when all agree."""
    if bool(rows.all()):
        return new
    if not bool(rows.any()):
        return old
    return torch.where(rows.view(-1, *([1] * (new.dim() - 1))), new, old)


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
    r"""Solve :math:`M w = \text{rhs}` on the free anchors, :math:`M = \operatorname{diag}(s) - P P^\top`
    (``p`` anchors-first, so this is the paper's :math:`P^\top P`).

    ``w`` is 0 on the other anchors. A relative ridge of a few ``eps(dtype)`` keeps saturated or tied
    rows (where ``M`` is singular, its null space orthogonal to the right-hand side) finite; a system
    that is still singular gives ``w = 0`` (the Newton loop then treats the row as stalled).
    """
    ppt = p @ p.transpose(-1, -2)
    f = free.to(p.dtype)
    both = f.unsqueeze(-1) * f.unsqueeze(-2)
    eye = torch.eye(ppt.shape[-1], dtype=p.dtype, device=p.device)
    scale = (s * f).amax(dim=-1, keepdim=True).clamp_min(1).unsqueeze(-1)
    ridge = RIDGE_ULPS * torch.finfo(p.dtype).eps * scale
    mat = (torch.diag_embed(s) - ppt) * both + eye * (1 - f).unsqueeze(-1) + ridge * eye * f.unsqueeze(-1)
    w, info = torch.linalg.solve_ex(mat, (rhs * f).unsqueeze(-1))
    w = w.squeeze(-1) * f
    return torch.where((info == 0).unsqueeze(-1) & torch.isfinite(w).all(-1, keepdim=True), w, torch.zeros_like(w))


def initial_thresholds(u: Tensor, valid: Tensor, c: Tensor, top: Optional[Tensor] = None) -> Tensor:
    """Thresholds (rows, m-1) of the hard assignment: the boundary between consecutive active anchors
    ``l`` and ``l + 1`` sits halfway between the last element that anchor ``l`` should hold and the next
    one; ``-inf`` where anchor ``l + 1`` is inactive. ``top``: the row's largest valid ``u`` in decreasing
    order (``-inf`` past the valid ones), at least as many as the anchors before the last one hold plus
    one, if the caller has them already."""
    rows, n = u.shape
    cum = torch.cumsum(c, dim=-1).round().long()                  # elements held by anchors 0..l
    held_before_last = int(c[:, :-1].sum(-1).max().round().item()) if rows else 0
    kk = max(1, min(n, held_before_last + 1))
    if top is None or top.shape[-1] < kk:
        top = torch.topk(torch.where(valid, u, torch.full_like(u, -torch.inf)), kk, dim=-1).values
    top = top[:, :kk]
    above = top.gather(-1, (cum[:, :-1] - 1).clamp(0, kk - 1))
    below = top.gather(-1, cum[:, :-1].clamp(0, kk - 1))
    boundary = hard_boundary(above, below)
    return torch.where(c[:, 1:] > 0, boundary, torch.full_like(boundary, -torch.inf))


def hard_boundary(above: Tensor, below: Tensor) -> Tensor:
    """The threshold between the last normalised score an anchor should hold (``above``) and the next one
    (``below``): their midpoint -- except across a gap wider than 2 * SATURATION, where any boundary at least
    SATURATION from both sides separates the groups completely, and the one nearest 0 keeps Newton's steps
    well resolved. 0 where that is not finite."""
    boundary = 0.5 * (above + below)
    margin = SATURATION + 8 * torch.finfo(above.dtype).eps * (above.abs() + below.abs())  # survives rounding
    wide = (above - below) > 2 * margin
    boundary = torch.where(wide, torch.minimum(torch.maximum(torch.zeros_like(boundary), below + margin),
                                               above - margin), boundary)
    return torch.nan_to_num(boundary, nan=0.0, posinf=0.0, neginf=0.0)


def unsorted_start(top: Tensor, n_valid: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """The unsorted root's start and shift per row, from the row's largest normalised valid scores ``top``
    (rows, >= min(k + 1, n)), decreasing: the hard-assignment threshold between the k-th and (k+1)-th
    (:func:`initial_thresholds` with anchors (1, 0)) and log((n_valid - k) / k) (:func:`log_mass_shift`);
    both 0 on rows with ``n_valid <= k``. A few operations, where the general thresholds take dozens."""
    if top.shape[-1] <= k:  # n == k: no row has anything to select
        zeros = top.new_zeros(top.shape[:1])
        return zeros, zeros
    solve = n_valid > k
    tau0 = torch.where(solve, hard_boundary(top[:, k - 1], top[:, k]), 0.0)
    shift = torch.where(solve, torch.log((n_valid - k).clamp_min(1).to(top.dtype)) - math.log(k), 0.0)
    return tau0, shift


class _Problem(NamedTuple):
    """The rows of a sorted problem the solver works on: normalised scores ``u`` (rows, n), their mask (None:
    all valid), the anchor masses ``c`` (rows, m) and which anchors are free."""

    u: Tensor
    mask: Optional[Tensor]
    c: Tensor
    free: Tensor

    def rows(self, index: Tensor) -> "_Problem":
        return _Problem(self.u[index], None if self.mask is None else self.mask[index], self.c[index],
                        self.free[index])

    def evaluate(self, t: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """The plan at thresholds ``t``, its anchor masses and its marginal error."""
        p = _plan(self.u, self.mask, t)
        s = p.sum(dim=-1)
        return p, s, _marginal_error(s, self.c)


def _start(problem: _Problem, valid: Tensor, top: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Thresholds to start from, with their (plan, masses, error). Two starting points: the hard assignment (best
    when eps is small against the score gaps) and the same with h shifted by log c (best when eps is large:
    then P_il ~ c_l); each row keeps the better one (the second is tried only where the first is poor)."""
    t = initial_thresholds(problem.u, valid, problem.c, top)
    p, s, err = problem.evaluate(t)
    retry = err > SECOND_START_ERROR
    if bool(retry.any()):
        idx = retry.nonzero().squeeze(-1)
        t2 = t[idx] + log_mass_shift(problem.c[idx])
        p2, s2, err2 = problem.rows(idx).evaluate(t2)
        better = err2 < err[idx]
        if bool(better.all()) and len(idx) == len(t):
            t, p, s, err = t2, p2, s2, err2
        elif bool(better.any()):
            sel, b = idx[better], better.nonzero().squeeze(-1)
            t[sel], p[sel], s[sel], err[sel] = t2[b], p2[b], s2[b], err2[b]
    return t, p, s, err


def _damped_step(problem: _Problem, t: Tensor, p: Tensor, s: Tensor, err: Tensor, tol: float,
                 max_halvings: int) -> Tuple[Tuple[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """One damped Newton step of every row: the new (thresholds, plan, masses, error), and which rows accepted
    a step. A step is accepted when it lowers the marginal error (or meets ``tol``), else halved."""
    step = hessian_solve(p, s, problem.free, problem.c - s)
    # Trust region: no potential moves by more than MAX_STEP (anchor masses change by at most
    # e^MAX_STEP) -- far from the optimum the full Newton step overshoots; near it, it is small.
    alpha = (MAX_STEP / step.abs().amax(-1, keepdim=True).clamp_min(MAX_STEP)).to(t.dtype)
    accepted = torch.zeros(len(t), dtype=torch.bool, device=t.device)
    # A Newton step dh on the potentials moves threshold t_l by dh_{l+1} - dh_l.
    step_t = step[:, 1:] - step[:, :-1]
    new = (t, p, s, err)
    for tries in range(max_halvings):
        trial_t = t + alpha * step_t
        trial = (trial_t, *problem.evaluate(trial_t))
        ok = ~accepted & ((trial[3] < err) | (trial[3] <= tol))
        new = tuple(_pick(ok, a, b) for a, b in zip(trial, new))
        accepted = accepted | ok
        # Near convergence, two failed halvings mean the row sits at its float rounding floor.
        settled = accepted | ((err < NEAR_FLOOR) & (tries >= 1))
        if bool(settled.all()):
            break
        alpha = torch.where(accepted.unsqueeze(-1), alpha, alpha * 0.5)
    return new, accepted


def newton_semi_dual(u: Tensor, valid: Tensor, c: Tensor, tol: float, max_iter: int,
                     max_halvings: int = MAX_HALVINGS, top: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Damped Newton on the semi-dual. Returns ``(P, info)``: P (rows, m, n), info (rows, 2) =
    iterations, marginal error.

    A step is accepted when it lowers the marginal error (not the objective: in float32 the objective's
    change near the optimum falls below its resolution and an Armijo test would stall); otherwise it is
    halved. Rows stop individually once their error is at most ``tol``, or when no halved step helps
    (their rounding floor).
    """
    rows = u.shape[0]
    problem = _Problem(u, None if bool(valid.all()) else valid, c, free_anchors(c))
    t, p, s, err = _start(problem, valid, top)
    iters = torch.zeros(rows, dtype=u.dtype, device=u.device)
    # Work only on the rows still iterating ("active", indices ``act``); a row leaving the set stores
    # its final plan into ``p`` first.
    act = torch.arange(rows, device=u.device)
    active = problem
    a_t, a_p, a_s, a_err = t, p, s, err
    a_todo = a_err > tol
    for _ in range(max_iter):
        if not bool(a_todo.any()):
            break
        if not bool(a_todo.all()):
            leaving = act[~a_todo]
            p[leaving] = a_p[~a_todo]
            keep = a_todo.nonzero().squeeze(-1)
            act = act[keep]
            active = active.rows(keep)
            a_t, a_p, a_s, a_err = a_t[keep], a_p[keep], a_s[keep], a_err[keep]
        (a_t, a_p, a_s, a_err), accepted = _damped_step(active, a_t, a_p, a_s, a_err, tol, max_halvings)
        iters[act] += 1
        if len(act) == rows:
            t, s, err = a_t, a_s, a_err
        else:
            t[act], s[act], err[act] = a_t, a_s, a_err
        # A row for which no halved step helped has reached its rounding floor: it stops there.
        a_todo = (a_err > tol) & accepted
    if len(act) == rows:
        p = a_p
    else:
        p[act] = a_p
    return p, torch.stack([iters, err], dim=-1)


def newton_sigmoid_root(u: Tensor, valid: Tensor, k: int, tol: float, max_iter: int,
                        top: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    r"""The unsorted operator directly: :math:`A_i = \sigma(u_i - \tau)` with :math:`\sum_i A_i = k`.

    With two anchors the plan's first column is this sigmoid (``_plan`` with ``m = 2``), so the problem is
    one monotone root per row. Safeguarded Newton: :math:`f(\tau) = \sum_i \sigma(u_i - \tau) - k`,
    :math:`f' = -\sum_i a_i` with :math:`a = A(1 - A)`, inside the bracket
    :math:`[u_{\min} - L, u_{\max} - L]`, :math:`L = \log(k / (n - k))` (where :math:`f \ge 0` and
    :math:`\le 0`), bisecting whenever a step leaves it. Rows with ``n_valid <= k`` are all ones.
    Where :math:`k \le` ``LOG_STEP_FRACTION`` :math:`n` the step is Newton's on :math:`\log S - \log k`,
    :math:`S = \sum_i A_i`, i.e. :math:`(\log S - \log k)\,S / \sum_i a_i`: the same root, reached in fewer
    steps from the tail.
    Where :math:`2k > n` (``n`` the row's valid elements) :math:`f` is evaluated from the unselected side,
    :math:`f = (n - k) - \sum_i \sigma(\tau - u_i)`: the same function, but a float32 sum of values near 1
    carries ~1e-7 of rounding per element, which relative to the scale :math:`n - k` of the error would stop the
    search short of ``tol`` (at k = 299 of 300, ~3e-5); the complements are small and summed exactly enough.
    Returns ``(A, info)`` with info = (iterations, relative mass error) per row, as the other solvers.
    """
    rows, n = u.shape
    n_valid = valid.sum(-1)
    nv = n_valid.to(u.dtype)
    solve = n_valid > k
    if top is None or top.shape[-1] < min(k + 1, n):
        top = torch.topk(torch.where(valid, u, torch.full_like(u, -torch.inf)), min(k + 1, n), dim=-1).values
    # Start: the hard-assignment threshold, or the same shifted by log((n-k)/k). With anchors (1, 0), tau is the
    # threshold t_0 and log(c_1 / c_0) = log((n - k) / k) = -L.
    tau, shift = unsorted_start(top, n_valid, k)
    u_max = torch.where(valid, u, torch.full_like(u, -torch.inf)).amax(-1)
    u_min = torch.where(valid, u, torch.full_like(u, torch.inf)).amin(-1)
    lo = torch.where(solve, u_min + shift, torch.zeros_like(shift))
    hi = torch.where(solve, u_max + shift, torch.zeros_like(shift))
    scale = torch.minimum(torch.full_like(nv, float(k)), nv - k).clamp_min(1)
    log_step = k <= LOG_STEP_FRACTION * nv
    from_complement = 2 * k > n_valid  # f from the unselected side (docstring)
    any_complement = bool(from_complement.any())

    def evaluate(tau):
        a = torch.where(valid, torch.sigmoid(u - tau.unsqueeze(-1)), torch.zeros_like(u))
        f = a.sum(-1) - k
        if any_complement:
            unselected = torch.where(valid, torch.sigmoid(tau.unsqueeze(-1) - u), torch.zeros_like(u)).sum(-1)
            f = torch.where(from_complement, (nv - k) - unselected, f)
        return a, f, (f.abs() / scale).masked_fill(~solve, 0.0)

    a, f, err = evaluate(tau)
    tau2 = tau + shift
    a2, f2, err2 = evaluate(tau2)
    better = err2 < err
    tau, a, f, err = (_pick(better, x2, x1) for x2, x1 in ((tau2, tau), (a2, a), (f2, f), (err2, err)))
    iters = torch.zeros(rows, dtype=u.dtype, device=u.device)
    done = err <= tol
    for _ in range(max_iter):
        todo = ~done
        if not bool(todo.any()):
            break
        lo = torch.where(f > 0, torch.maximum(lo, tau), lo)   # f decreases in tau: the root is above
        hi = torch.where(f < 0, torch.minimum(hi, tau), hi)
        slope = (a * (1 - a)).sum(-1).clamp_min(torch.finfo(u.dtype).tiny)
        mass = f + k
        step = torch.where(log_step, tau + (torch.log(mass) - math.log(k)) * mass / slope, tau + f / slope)
        inside = (step > lo) & (step < hi) & torch.isfinite(step)
        new_tau = torch.where(inside, step, 0.5 * (lo + hi))
        new_tau = torch.where(todo, new_tau, tau)
        new_a, new_f, new_err = evaluate(new_tau)
        # A row whose step no longer moves tau sits at its rounding floor: it stops there.
        stuck = todo & (new_tau == tau)
        tau, a, f, err = new_tau, new_a, new_f, new_err
        iters = iters + todo.to(u.dtype)
        done = done | (err <= tol) | stuck
    a = torch.where((~solve).unsqueeze(-1), valid.to(u.dtype), a)
    return a, torch.stack([iters, err], dim=-1)


def _thresholds(h: Tensor) -> Tensor:
    """t_l = h_{l+1} - h_l, -inf where anchor l+1 is inactive (h = -inf)."""
    return torch.where(torch.isfinite(h[:, 1:]), h[:, 1:] - h[:, :-1], torch.full_like(h[:, 1:], -torch.inf))


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
    kernel = torch.where(valid, u, torch.zeros_like(u)).unsqueeze(-2) * y.unsqueeze(-1)   # (rows, m, n)
    log_c = torch.where(c > 0, torch.log(c.clamp_min(1e-300)), neg_inf)
    b = torch.where(c > 0, torch.zeros_like(c), neg_inf)
    rows = u.shape[0]
    iters = torch.zeros(rows, dtype=u.dtype, device=u.device)
    has_anchor = (c > 0).any(-1)
    live = valid & has_anchor.unsqueeze(-1)
    for _ in range(max_iter):
        a = -torch.logsumexp(kernel + b.unsqueeze(-1), dim=-2)
        a = torch.where(live, a, neg_inf)
        col = torch.logsumexp(kernel + a.unsqueeze(-2), dim=-1)
        b = torch.where(c > 0, log_c - col, neg_inf)
        iters += 1
        if tol is not None:
            if bool((_marginal_error(_plan(u, live, _thresholds(b)).sum(-1), c) <= tol).all()):
                break
    p = torch.nan_to_num(_plan(u, live, _thresholds(b)), nan=0.0)
    return p, torch.stack([iters, _marginal_error(p.sum(-1), c)], dim=-1)
