"""Fused Triton kernels for SOFT top-k on CUDA tensors. Each operator, sorted and unsorted, is one launch each
way, from the raw scores: on a GPU a soft beam-search update, or a training step of top-k attention, is bound by
the host issuing operations, not by the GPU, so everything a call needs is done inside the kernel. The math is
the one of ``solvers.py`` / ``backward.py`` and the schedule the one of the C kernels (``soft_topk_cpu.c``):
same threshold parameterisation, same two starting points, same damping rule (trust region of ``MAX_STEP`` on
the potentials, then halving, accepted when the marginal error drops), same Hessian and ridge. The solver
constants are ``solvers.KERNEL_CONSTANTS`` (and ``BACKWARD_KERNEL_CONSTANTS``, ``SATURATION``), and the status
bits ``kernel_interface.REFUSAL_BITS``, passed in as constexpr arguments (never restated here).

* sorted forward (:func:`forward`): one program per row. It streams the row's raw scores to find what
  ``backends.Backend.solve`` prepares with a few dozen tensor operations -- the valid entries (not ``-inf``,
  not masked), bad scores (a status, ``kernel_interface.REFUSAL_BITS``), the paper scaling's temperature, the
  top-(k+1) valid scores (one pass per distinct value), the centre x_(k), the anchor masses and the
  hard-assignment thresholds -- then keeps the thresholds (anchor axis padded to ``MP``), the anchor masses
  ``s`` and the Hessian ``diag(s) - P P^T`` in registers. Each Newton evaluation streams the scores once in
  blocks of ``BLOCK_N``, normalising them on the fly as ``clamp((x - centre) / eps, +-bound)`` (the plan is
  never stored); the ``m x m`` system is solved in registers by Gauss-Jordan elimination. A last pass writes
  the output. A few long rows (fewer than half the GPU's SMs, :func:`split_parts`) are split across programs
  instead: a launch per evaluation, several programs per row each summing its chunk, one program per row
  adding the partials and taking the same decisions; the host asks every ``SPLIT_ROUNDS`` rounds whether a
  row is still going (one read back each time).
* sorted backward (:func:`backward`): three streaming passes per row -- the valid count, then ``v`` and ``M``,
  then the gradient (and dL/deps, ``implicit_backward.temperature_grad``, in the same pass).
* unsorted forward (:func:`unsorted_forward`): one program per row, from the raw scores too, as the C unsorted
  kernel: the same scan (valid entries, status bits, extremes, the paper temperature), the centre x_(k) and
  the next score by a bisection on the scores' order (32 passes whatever k is), the start
  (``solvers.unsorted_start``), then the scalar root of ``solvers.newton_sigmoid_root``.
* unsorted backward (:func:`unsorted_backward`): two passes per row, dL/deps in the second.
* the paper scaling's temperature alone (:func:`paper_temperature`).

A bad row (its status bits set) is not solved: the forwards write it as NaN, and the backwards write NaN for a
row whose output is NaN -- what ``soft_topk(..., check_errors=False)`` returns, with no operation outside the
kernels (the checked call raises on the status instead).

Kept free of libdevice, inline asm, block pointers and ``break``, so that the interpreter
(``TRITON_INTERPRET=1``) runs it on CPU tensors for the tests.
"""
import torch
import triton
import triton.language as tl

from softtopk_fairseq.ops.kernel_interface import CAPPED, REFUSAL_BITS, ensure_contiguous, temperature_outputs
from softtopk_fairseq.ops.solvers import (BACKWARD_KERNEL_CONSTANTS, KERNEL_CONSTANTS, MAX_HALVINGS, SATURATION,
                                          UNSORTED_KERNEL_CONSTANTS)

# float32's machine epsilon (torch.finfo(torch.float32).eps), for the ridge and the hard boundary's margin.
FLT_EPS = tl.constexpr(1.1920928955078125e-07)
FLT_TINY = tl.constexpr(1.1754943508222875e-38)  # the smallest normal float: a floor for divisors
FLT_MAX = tl.constexpr(3.4028234663852886e38)  # the largest float


@triton.jit
def _raw_tile(x_ptr, valid_ptr, row, n, start, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Raw scores x (BLOCK_N,) of elements start..start+BLOCK_N of ``row`` (0 where invalid) and their validity:
    in the row, not ``-inf``, and where ``HAS_MASK``, True in the bool mask at ``valid_ptr``."""
    offs_n = start + tl.arange(0, BLOCK_N)
    keep = offs_n < n
    if HAS_MASK:
        keep = keep & (tl.load(valid_ptr + row * n + offs_n, mask=offs_n < n, other=0) != 0)
    x = tl.load(x_ptr + row * n + offs_n, mask=keep, other=0.0)
    keep = keep & (x != float("-inf"))
    return tl.where(keep, x, 0.0), keep


@triton.jit
def _plan_tile(x_ptr, valid_ptr, row, n, start, centre, eps, bound, tz, m_act, HAS_MASK: tl.constexpr,
               MP: tl.constexpr, BLOCK_N: tl.constexpr, LOGIT_CLAMP: tl.constexpr):
    """P tile (BLOCK_N, MP) of elements start..start+BLOCK_N of ``row``; zero rows where invalid."""
    x, keep = _raw_tile(x_ptr, valid_ptr, row, n, start, HAS_MASK, BLOCK_N)
    # Rounded division, as in solvers.normalise_scores: the same u, bit for bit, as the other backends.
    u = tl.minimum(tl.maximum(tl.div_rn(x - centre, eps), -bound), bound)
    u = tl.where(keep, u, 0.0)
    lane = tl.arange(0, MP)
    # z_l = sum_{j < l} (t_j - u): running sum of the clamped, shifted differences tz[l] - u.
    d = tz[None, :] - u[:, None]
    d = tl.minimum(tl.maximum(d, -LOGIT_CLAMP), LOGIT_CLAMP)
    d = tl.where((lane[None, :] >= 1) & (lane[None, :] < m_act), d, 0.0)
    z = tl.cumsum(d, axis=1)
    z = tl.where(lane[None, :] < m_act, z, float("-inf"))
    zmax = tl.max(z, axis=1)
    zmax = tl.where(zmax == float("-inf"), 0.0, zmax)  # rows with no active anchor: no -inf - -inf
    e = tl.exp(z - zmax[:, None])
    p = e / tl.maximum(tl.sum(e, axis=1), 1.0)[:, None]  # the sum is >= 1 (the max term) unless no anchor
    return tl.where(keep[:, None], p, 0.0)


@triton.jit
def _plan_sums(x_ptr, valid_ptr, row, n, lo, hi, centre, eps, bound, tz, m_act, HAS_MASK: tl.constexpr,
               MP: tl.constexpr, BLOCK_N: tl.constexpr, LOGIT_CLAMP: tl.constexpr):
    """Anchor masses s (MP,) and P P^T (MP, MP) of the plan at thresholds tz over the row's elements lo..hi (lo a
    multiple of BLOCK_N, and hi too unless it is n)."""
    s = tl.zeros((MP,), dtype=tl.float32)
    ppt = tl.zeros((MP, MP), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        p = _plan_tile(x_ptr, valid_ptr, row, n, start, centre, eps, bound, tz, m_act, HAS_MASK, MP, BLOCK_N,
                       LOGIT_CLAMP)
        s += tl.sum(p, axis=0)
        ppt += tl.sum(p[:, :, None] * p[:, None, :], axis=0)
    return s, ppt


@triton.jit
def _marginal_error(s, c, m_act, MP: tl.constexpr):
    """The max relative marginal error |s - c| / max(c, 1) over the active anchors."""
    lane = tl.arange(0, MP)
    return tl.max(tl.where((lane < m_act) & (c > 0), tl.abs(s - c) / tl.maximum(c, 1.0), 0.0), axis=0)


@triton.jit
def _evaluate(x_ptr, valid_ptr, row, n, centre, eps, bound, tz, m_act, c, HAS_MASK: tl.constexpr,
              MP: tl.constexpr, BLOCK_N: tl.constexpr, LOGIT_CLAMP: tl.constexpr):
    """Anchor masses s (MP,), P P^T (MP, MP) and the max relative marginal error for thresholds tz."""
    s, ppt = _plan_sums(x_ptr, valid_ptr, row, n, 0, n, centre, eps, bound, tz, m_act, HAS_MASK, MP, BLOCK_N,
                        LOGIT_CLAMP)
    return s, ppt, _marginal_error(s, c, m_act, MP)


@triton.jit
def _row_scan(x_ptr, valid_ptr, row, n, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    """One streaming pass over the row: its number of valid entries, whether it holds a NaN (anywhere, masked or
    not, as backends._check_scores) or +inf (on a valid entry), and its largest and smallest valid scores with
    where they are (first occurrences): (n_valid, has_nan, has_inf, hi, lo, hi_at, lo_at)."""
    n_valid = tl.zeros((), dtype=tl.int32)
    nan = tl.zeros((), dtype=tl.int32)
    inf = tl.zeros((), dtype=tl.int32)
    hi = tl.full((), float("-inf"), tl.float32)
    lo = tl.full((), float("inf"), tl.float32)
    hi_at = tl.zeros((), dtype=tl.int32)
    lo_at = tl.zeros((), dtype=tl.int32)
    for start in range(0, n, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        raw = tl.load(x_ptr + row * n + offs_n, mask=offs_n < n, other=0.0)
        x, keep = _raw_tile(x_ptr, valid_ptr, row, n, start, HAS_MASK, BLOCK_N)
        n_valid += tl.sum(keep.to(tl.int32), axis=0)
        nan = tl.maximum(nan, tl.max((raw != raw).to(tl.int32), axis=0))
        inf = tl.maximum(inf, tl.max((keep & (x == float("inf"))).to(tl.int32), axis=0))
        up = tl.where(keep, x, float("-inf"))
        down = tl.where(keep, x, float("inf"))
        tile_hi = tl.max(up, axis=0)
        tile_lo = tl.min(down, axis=0)
        hi_at = tl.where(tile_hi > hi, start + tl.argmax(up, axis=0), hi_at)
        lo_at = tl.where(tile_lo < lo, start + tl.argmin(down, axis=0), lo_at)
        hi = tl.maximum(hi, tile_hi)
        lo = tl.minimum(lo, tile_lo)
    return n_valid, nan > 0, inf > 0, hi, lo, hi_at, lo_at


@triton.jit
def _row_top(x_ptr, valid_ptr, row, n, kk, HAS_MASK: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr):
    """The ``kk`` (<= MP) largest valid scores of ``row``, decreasing, in lanes 0..kk-1 (``-inf`` past the valid
    ones; later lanes may repeat a tie): one streaming pass per distinct value, each finding the largest value
    below the last one and how often it occurs. (NaN and +inf are never taken: the row is reported bad.)"""
    lane = tl.arange(0, MP)
    top = tl.full((MP,), float("-inf"), tl.float32)
    filled = tl.zeros((), dtype=tl.int32)
    below = tl.full((), float("inf"), tl.float32)
    while (filled < kk) & (below > float("-inf")):
        best = tl.full((), float("-inf"), tl.float32)
        count = tl.zeros((), dtype=tl.int32)
        for start in range(0, n, BLOCK_N):
            x, keep = _raw_tile(x_ptr, valid_ptr, row, n, start, HAS_MASK, BLOCK_N)
            cand = keep & (x < below)
            tile_best = tl.max(tl.where(cand, x, float("-inf")), axis=0)
            tile_count = tl.sum((cand & (x == tile_best)).to(tl.int32), axis=0)
            count = tl.where(tile_best > best, tile_count, tl.where(tile_best == best, count + tile_count, count))
            best = tl.maximum(best, tile_best)
        count = tl.where(best > float("-inf"), count, 0)
        top = tl.where((lane >= filled) & (lane < filled + count), best, top)
        filled += count
        below = best
    return top


@triton.jit
def _hard_boundary(above, below, SATURATION: tl.constexpr):
    """solvers.hard_boundary: the midpoint of the last normalised score an anchor should hold and the next one,
    or across a gap wider than 2 * SATURATION the boundary nearest 0 at least SATURATION from both; 0 where
    that is not finite."""
    boundary = 0.5 * (above + below)
    margin = SATURATION + 8 * FLT_EPS * (tl.abs(above) + tl.abs(below))
    wide = (above - below) > 2 * margin
    boundary = tl.where(wide, tl.minimum(tl.maximum(0.0, below + margin), above - margin), boundary)
    return tl.where((boundary == boundary) & (tl.abs(boundary) < float("inf")), boundary, 0.0)


@triton.jit
def _paper_temperature(hi, lo, hi_at, lo_at, anchor_top, epsilon):
    """The paper scaling's temperature of one row (backends.Backend.paper_temperature, soft_topk_cpu.c) from its
    largest and smallest valid scores and where they are (:func:`_row_scan`): the cost max(v^2, (v - K)^2) at
    both, eps = epsilon * M / 2 (epsilon when M = 0 or nothing is valid), where M sits and d eps / d x there:
    (eps, at, slope)."""
    any_valid = hi > float("-inf")
    hi = tl.where(any_valid, hi, 0.0)
    lo = tl.where(any_valid, lo, 0.0)
    hi_up = hi * hi
    hi_down = (hi - anchor_top) * (hi - anchor_top)
    lo_up = lo * lo
    lo_down = (lo - anchor_top) * (lo - anchor_top)
    cost_hi = tl.maximum(hi_up, hi_down)
    cost_lo = tl.maximum(lo_up, lo_down)
    slope_hi = tl.where(hi_up >= hi_down, 2.0 * hi, 2.0 * (hi - anchor_top))
    slope_lo = tl.where(lo_up >= lo_down, 2.0 * lo, 2.0 * (lo - anchor_top))
    use_hi = cost_hi >= cost_lo
    cost = tl.where(use_hi, cost_hi, cost_lo)
    positive = (cost > 0.0) & any_valid
    eps = tl.where(positive, epsilon * cost / 2.0, epsilon)
    slope = tl.where(positive, epsilon / 2.0 * tl.where(use_hi, slope_hi, slope_lo), 0.0)
    return eps, tl.where(use_hi, hi_at, lo_at), slope


@triton.jit
def _scan_and_temperature(x_ptr, valid_ptr, eps_ptr, at_ptr, slope_ptr, row, n, anchor_top, epsilon,
                          HAS_MASK: tl.constexpr, PAPER: tl.constexpr, EPS_PER_ROW: tl.constexpr,
                          BLOCK_N: tl.constexpr, BAD_NAN: tl.constexpr, BAD_INF: tl.constexpr,
                          BAD_SCALE: tl.constexpr):
    """A forward's first pass over its row (:func:`_row_scan`): with ``PAPER`` the paper scaling's temperature
    (stores eps, at, slope), else reads eps (``EPS_PER_ROW``) or takes ``epsilon`` for every row; returns
    (n_valid, status, the largest and the smallest valid score, eps) -- status: the row's refusal bits
    (``kernel_interface.REFUSAL_BITS``: a NaN, +inf on a valid entry, an infinite temperature with a range of
    scores that overflows), which the forward stores at its end (:func:`_store_capped`)."""
    n_valid, has_nan, has_inf, hi, lo, hi_at, lo_at = _row_scan(x_ptr, valid_ptr, row, n, HAS_MASK, BLOCK_N)
    if PAPER:
        eps, at, slope = _paper_temperature(hi, lo, hi_at, lo_at, anchor_top, epsilon)
        tl.store(eps_ptr + row, eps)
        tl.store(at_ptr + row, at.to(tl.int64))
        tl.store(slope_ptr + row, slope)
    elif EPS_PER_ROW:
        eps = tl.load(eps_ptr + row)
    else:
        eps = epsilon
    bad_scale = ~(eps < float("inf")) & ((hi - lo) == float("inf"))
    status = tl.where(has_nan, BAD_NAN, 0) | tl.where(has_inf, BAD_INF, 0) | tl.where(bad_scale, BAD_SCALE, 0)
    return n_valid, status, hi, lo, eps


@triton.jit
def _store_capped(status_ptr, row, status, it, err, tol, max_iter, CAPPED: tl.constexpr):
    """Store the row's status: its refusal bits, and ``CAPPED`` when it stopped at max_iter above ``tol`` (never
    with tol 0, which asks for exactly max_iter iterations): one read of the status tells the caller whether to
    look at the info."""
    capped = (tol > 0) & (it >= max_iter) & (err > tol)
    tl.store(status_ptr + row, status | tl.where(capped, CAPPED, 0))


@triton.jit
def _add_temperature_share(grad_ptr, at_ptr, slope_ptr, row, n, grad_eps):
    """The paper scaling's share of dL/dx (implicit_backward.paper_temperature_grad): the temperature depends on
    one entry of the row, ``at``, with derivative ``slope`` (clamped to the float range: 0 * inf is 0 there),
    added to what this program stored there."""
    at = tl.load(at_ptr + row)
    slope = tl.load(slope_ptr + row)
    share = grad_eps * tl.minimum(tl.maximum(slope, -FLT_MAX), FLT_MAX)
    tl.debug_barrier()  # the row's gradient, stored by every thread of the program, before one of them reads it
    ptr = grad_ptr + row * n + at
    tl.store(ptr, tl.load(ptr) + share)


@triton.jit
def _store_gradient_tile(grad_ptr, row, n, start, grad, x, keep, x_mean, nans, moment, EPS_GRAD: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """Store a tile of dL/dx (NaN throughout a refused row, ``nans > 0``) and return ``moment`` with, under
    ``EPS_GRAD``, the tile's share of sum_i dL/dx_i (x_i - mean x) added (dL/deps = -moment / eps)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    tl.store(grad_ptr + row * n + offs_n, tl.where(nans == 0, grad, float("nan")), mask=offs_n < n)
    if EPS_GRAD:
        moment += tl.sum(tl.where(keep, grad * (x - x_mean), 0.0), axis=0)
    return moment


@triton.jit
def _store_temperature_grad(grad_ptr, grad_eps_ptr, at_ptr, slope_ptr, row, n, moment, eps, nans,
                            PAPER: tl.constexpr):
    """dL/deps = -moment / eps (implicit_backward.temperature_grad; NaN for a refused row): stored, or with
    ``PAPER`` added to dL/dx as the paper scaling's temperature passes it on (:func:`_add_temperature_share`)."""
    grad_eps = tl.where(nans == 0, -moment / eps, float("nan"))
    if PAPER:
        _add_temperature_share(grad_ptr, at_ptr, slope_ptr, row, n, grad_eps)
    else:
        tl.store(grad_eps_ptr + row, grad_eps)


@triton.jit
def _solve_free(s, ppt, rhs, m_act, MP: tl.constexpr, RIDGE_ULPS: tl.constexpr):
    """Solve (diag(s) - P P^T) x = rhs on the free anchors (active, not the pinned last one); x = 0 elsewhere."""
    lane = tl.arange(0, MP)
    ri = lane[:, None]
    ci = lane[None, :]
    free_r = lane < (m_act - 1)
    free2 = (ri < (m_act - 1)) & (ci < (m_act - 1))
    scale = tl.maximum(tl.max(tl.where(free_r, s, 0.0), axis=0), 1.0)
    ridge = RIDGE_ULPS * FLT_EPS * scale
    a = tl.where(ri == ci, s[:, None], 0.0) - ppt
    a = tl.where(free2, a, 0.0) + tl.where((ri == ci) & free2, ridge, 0.0) + tl.where((ri == ci) & ~free2, 1.0, 0.0)
    x = tl.where(free_r, rhs, 0.0)
    for q in tl.static_range(MP):  # Gauss-Jordan; the matrix is symmetric positive definite
        row_q = tl.sum(tl.where(ri == q, a, 0.0), axis=0)
        piv = tl.sum(tl.where(lane == q, row_q, 0.0), axis=0)
        x_q = tl.sum(tl.where(lane == q, x, 0.0), axis=0) / piv
        row_q = row_q / piv
        col_q = tl.sum(tl.where(ci == q, a, 0.0), axis=1)
        a = tl.where(ri == q, row_q[None, :], a - col_q[:, None] * row_q[None, :])
        x = tl.where(lane == q, x_q, x - col_q * x_q)
    return tl.where(free_r, x, 0.0)


@triton.jit
def _store_output(x_ptr, valid_ptr, out_ptr, row, n, k, lo, hi, centre, eps, bound, tz, m_act, status,
                  HAS_MASK: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr, LOGIT_CLAMP: tl.constexpr):
    """The sorted output over the row's elements lo..hi (as :func:`_plan_sums`): the plan at thresholds tz, its
    first k anchors; NaN for a bad row (status set: what check_errors=False returns)."""
    lane = tl.arange(0, MP)
    for start in range(lo, hi, BLOCK_N):
        p = _plan_tile(x_ptr, valid_ptr, row, n, start, centre, eps, bound, tz, m_act, HAS_MASK, MP, BLOCK_N,
                       LOGIT_CLAMP)
        p = tl.where(status == 0, p, float("nan"))
        offs_n = start + tl.arange(0, BLOCK_N)
        ptrs = out_ptr + (row * n + offs_n[:, None]) * k + lane[None, :]
        tl.store(ptrs, p, mask=(offs_n[:, None] < n) & (lane[None, :] < k))


@triton.jit
def _newton_direction(s, ppt, c, m_act, MP: tl.constexpr, MAX_STEP: tl.constexpr, RIDGE_ULPS: tl.constexpr):
    """The damped Newton step's first try (solvers.newton_semi_dual): (alpha, dtz), the thresholds' move dtz
    scaled by alpha so that no potential moves by more than MAX_STEP (the trust region)."""
    lane = tl.arange(0, MP)
    dh = _solve_free(s, ppt, c - s, m_act, MP, RIDGE_ULPS)
    alpha = MAX_STEP / tl.maximum(tl.max(tl.abs(dh), axis=0), MAX_STEP)
    # dt_l = dh_{l+1} - dh_l, stored shifted: dtz[l] = dh_l - dh_{l-1}.
    dh_prev = tl.sum(tl.where(lane[None, :] == lane[:, None] - 1, dh[None, :], 0.0), axis=1)
    return alpha, tl.where((lane >= 1) & (lane < m_act), dh - dh_prev, 0.0)


@triton.jit
def _sorted_start(x_ptr, valid_ptr, eps_ptr, at_ptr, slope_ptr, row, n, k, bound, anchor_top, epsilon,
                  HAS_MASK: tl.constexpr, PAPER: tl.constexpr, EPS_PER_ROW: tl.constexpr, MP: tl.constexpr,
                  BLOCK_N: tl.constexpr, SATURATION: tl.constexpr, BAD_NAN: tl.constexpr, BAD_INF: tl.constexpr,
                  BAD_SCALE: tl.constexpr):
    """The sorted forward's preparation of ``row`` from its raw scores (``backends.Backend.solve``'s): returns
    (n_valid, status, eps, the anchor masses c, the number of active anchors, the centre, the starting
    thresholds tz)."""
    lane = tl.arange(0, MP)
    n_valid, status, _, _, eps = _scan_and_temperature(x_ptr, valid_ptr, eps_ptr, at_ptr, slope_ptr, row,
                                                       n, anchor_top, epsilon, HAS_MASK, PAPER, EPS_PER_ROW, BLOCK_N,
                                                       BAD_NAN, BAD_INF, BAD_SCALE)
    # Anchors 0..k-1 (ranks) hold 1 each while there are valid entries for them; anchor k the other n - k.
    c = tl.where(lane < k, (lane < n_valid).to(tl.float32), 0.0)
    c = tl.where(lane == k, tl.maximum(n_valid - k, 0).to(tl.float32), c)
    m_act = tl.sum((c > 0).to(tl.int32), axis=0)
    # The centre x_(k) (the k-th largest valid score; 0 for an empty row) and the normalised top-(k+1).
    top = _row_top(x_ptr, valid_ptr, row, n, k + 1, HAS_MASK, MP, BLOCK_N)
    kth = tl.maximum(tl.minimum(n_valid, k) - 1, 0)
    centre = tl.sum(tl.where(lane == kth, top, 0.0), axis=0)
    centre = tl.where((centre == centre) & (tl.abs(centre) < float("inf")), centre, 0.0)
    u_top = tl.where(top > float("-inf"), tl.minimum(tl.maximum(tl.div_rn(top - centre, eps), -bound), bound),
                     float("-inf"))
    # Hard-assignment start (solvers.initial_thresholds), stored shifted: tz[l] = t_{l-1}, the boundary
    # between the l-th largest and the next; 0 where anchor l is inactive (m_act switches it off). The inactive
    # lanes' -inf scores are zeroed before the arithmetic, which would otherwise form inf - inf there.
    live = (lane >= 1) & (lane < m_act)
    u_prev = tl.sum(tl.where(lane[None, :] == lane[:, None] - 1, u_top[None, :], 0.0), axis=1)
    tz = tl.where(live, _hard_boundary(tl.where(live, u_prev, 0.0), tl.where(live, u_top, 0.0), SATURATION), 0.0)
    return n_valid, status, eps, c, m_act, centre, tz


@triton.jit
def soft_topk_forward_kernel(x_ptr, valid_ptr, eps_ptr, at_ptr, slope_ptr, out_ptr, info_ptr, status_ptr, n, k,
                             bound, tol, max_iter, max_halvings, anchor_top, epsilon,
                             HAS_MASK: tl.constexpr, PAPER: tl.constexpr, EPS_PER_ROW: tl.constexpr,
                             MP: tl.constexpr, BLOCK_N: tl.constexpr, LOGIT_CLAMP: tl.constexpr, MAX_STEP: tl.constexpr, NEAR_FLOOR: tl.constexpr,
                             SECOND_START_ERROR: tl.constexpr, RIDGE_ULPS: tl.constexpr,
                             SATURATION: tl.constexpr, BAD_NAN: tl.constexpr, BAD_INF: tl.constexpr,
                             BAD_SCALE: tl.constexpr, CAPPED: tl.constexpr):
    """The sorted operator of one row from its raw scores: ``backends.Backend.solve``'s preparation, then
    ``solvers.newton_semi_dual``. ``valid_ptr``: the caller's bool mask (``HAS_MASK``); ``-inf`` is excluded
    in any case. ``PAPER``: the temperature is the paper scaling's (written to eps/at/slope), else read from
    ``eps_ptr`` (``EPS_PER_ROW``) or ``epsilon``. The row's status bits: the refusals, and ``CAPPED`` when it
    stopped at max_iter above ``tol``."""
    row = tl.program_id(0)
    lane = tl.arange(0, MP)
    n_valid, status, eps, c, m_act, centre, tz = _sorted_start(
        x_ptr, valid_ptr, eps_ptr, at_ptr, slope_ptr, row, n, k, bound, anchor_top, epsilon, HAS_MASK, PAPER,
        EPS_PER_ROW, MP, BLOCK_N, SATURATION, BAD_NAN, BAD_INF, BAD_SCALE)
    s, ppt, err = _evaluate(x_ptr, valid_ptr, row, n, centre, eps, bound, tz, m_act, c, HAS_MASK, MP, BLOCK_N,
                            LOGIT_CLAMP)
    # Second starting point (thresholds shifted by log c, solvers.log_mass_shift: only the rest anchor's mass
    # differs from 1): kept if it fits the masses better.
    if err > SECOND_START_ERROR:
        shift = tl.where((lane == k) & (n_valid > k), tl.log(tl.maximum(n_valid - k, 1).to(tl.float32)), 0.0)
        tz2 = tz + shift
        s2, ppt2, err2 = _evaluate(x_ptr, valid_ptr, row, n, centre, eps, bound, tz2, m_act, c, HAS_MASK, MP,
                                   BLOCK_N, LOGIT_CLAMP)
        if err2 < err:
            tz, s, ppt, err = tz2, s2, ppt2, err2
    it = tl.full((), 0, tl.int32)
    going = (err > tol) & (status == 0)  # a bad row is reported, not solved
    while going & (it < max_iter):
        alpha, dtz = _newton_direction(s, ppt, c, m_act, MP, MAX_STEP, RIDGE_ULPS)
        tries = tl.full((), 0, tl.int32)
        accepted = tl.full((), 0, tl.int32)
        # Near convergence (error < NEAR_FLOOR), two failed halvings mean a rounding floor.
        while (accepted == 0) & (tries < max_halvings) & ((err >= NEAR_FLOOR) | (tries < 2)):
            tz_t = tz + alpha * dtz
            s_t, ppt_t, err_t = _evaluate(x_ptr, valid_ptr, row, n, centre, eps, bound, tz_t, m_act, c,
                                          HAS_MASK, MP, BLOCK_N, LOGIT_CLAMP)
            take = (err_t < err) | (err_t <= tol)
            tz = tl.where(take, tz_t, tz)
            s = tl.where(take, s_t, s)
            ppt = tl.where(take, ppt_t, ppt)
            err = tl.where(take, err_t, err)
            accepted = tl.where(take, 1, accepted)
            alpha = alpha * 0.5
            tries += 1
        it += 1
        going = (err > tol) & (accepted == 1)  # no halved step helped: the row's rounding floor
    tl.store(info_ptr + row * 2, it.to(tl.float32))
    tl.store(info_ptr + row * 2 + 1, err)
    _store_capped(status_ptr, row, status, it, err, tol, max_iter, CAPPED)
    _store_output(x_ptr, valid_ptr, out_ptr, row, n, k, 0, n, centre, eps, bound, tz, m_act, status, HAS_MASK, MP,
                  BLOCK_N, LOGIT_CLAMP)


# ---- the sorted forward split across programs ---------------------------------------------------------------
# A few long rows (the beam search's 8 x 50000) leave a one-program-per-row kernel with a few SMs busy. Split, the
# solve is a loop of launches: every evaluation of the marginals is ``parts`` programs per row, each over its own
# chunk of the row, storing its partial masses and P P^T; then one program per row adds the partials and takes
# the single-program kernel's next decision -- the second start, the Newton step, a halving, the stop -- and
# names the next thresholds to evaluate. Each row's state lives in device memory between launches; a stopped
# row's programs return at once. The host checks whether any row is still going every ``SPLIT_ROUNDS`` rounds (one
# read back each time).
# What a row's pending evaluation is for (its phase), and the row's stop.
SPLIT_START, SPLIT_SECOND, SPLIT_TRIAL, SPLIT_DONE = (tl.constexpr(0), tl.constexpr(1), tl.constexpr(2),
                                                      tl.constexpr(3))
SPLIT_ROUNDS = 4
# A row's float state: centre, eps, err, alpha; then MP each of c, tz, the thresholds to evaluate, dtz, the
# second start's shift, s; then P P^T. Its int state: status, active anchors, iterations,
# halvings, phase.
SPLIT_SCALARS = tl.constexpr(4)


@triton.jit
def _split_state(state_ptr, row, MP: tl.constexpr):
    """Pointers into a row's float state: (its start, the base of the MP-vectors, the base of P P^T)."""
    base = state_ptr + row * (SPLIT_SCALARS + 6 * MP + MP * MP)
    return base, base + SPLIT_SCALARS, base + SPLIT_SCALARS + 6 * MP


@triton.jit
def sorted_split_start_kernel(x_ptr, valid_ptr, eps_ptr, at_ptr, slope_ptr, state_ptr, istate_ptr, n, k, bound,
                              anchor_top, epsilon, HAS_MASK: tl.constexpr, PAPER: tl.constexpr,
                              EPS_PER_ROW: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr,
                              SATURATION: tl.constexpr, BAD_NAN: tl.constexpr, BAD_INF: tl.constexpr,
                              BAD_SCALE: tl.constexpr):
    """One program per row: the preparation (:func:`_sorted_start`), stored as the row's state, with its start
    as the thresholds to evaluate first."""
    row = tl.program_id(0)
    lane = tl.arange(0, MP)
    n_valid, status, eps, c, m_act, centre, tz = _sorted_start(
        x_ptr, valid_ptr, eps_ptr, at_ptr, slope_ptr, row, n, k, bound, anchor_top, epsilon, HAS_MASK, PAPER,
        EPS_PER_ROW, MP, BLOCK_N, SATURATION, BAD_NAN, BAD_INF, BAD_SCALE)
    shift = tl.where((lane == k) & (n_valid > k), tl.log(tl.maximum(n_valid - k, 1).to(tl.float32)), 0.0)
    base, vec, _ = _split_state(state_ptr, row, MP)
    tl.store(base, centre)
    tl.store(base + 1, eps)
    tl.store(vec + lane, c)
    tl.store(vec + MP + lane, tz)
    tl.store(vec + 2 * MP + lane, tz)  # the thresholds to evaluate
    tl.store(vec + 4 * MP + lane, shift)
    tl.store(istate_ptr + row * 5, status)
    tl.store(istate_ptr + row * 5 + 1, m_act)
    tl.store(istate_ptr + row * 5 + 2, 0)  # iterations
    tl.store(istate_ptr + row * 5 + 3, 0)  # halvings of the current step
    tl.store(istate_ptr + row * 5 + 4, SPLIT_START)


@triton.jit
def sorted_split_evaluate_kernel(x_ptr, valid_ptr, state_ptr, istate_ptr, partial_ptr, n, bound, chunk,
                                 HAS_MASK: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr,
                                 LOGIT_CLAMP: tl.constexpr):
    """Program (row, part): the masses and P P^T of the row's plan over its elements part * chunk ... at the
    thresholds the row's state names, stored as the part's partial (nothing for a stopped row)."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    lane = tl.arange(0, MP)
    if tl.load(istate_ptr + row * 5 + 4) != SPLIT_DONE:
        base, vec, _ = _split_state(state_ptr, row, MP)
        centre = tl.load(base)
        eps = tl.load(base + 1)
        trial = tl.load(vec + 2 * MP + lane)
        m_act = tl.load(istate_ptr + row * 5 + 1)
        s, ppt = _plan_sums(x_ptr, valid_ptr, row, n, part * chunk, tl.minimum(n, (part + 1) * chunk), centre, eps,
                            bound, trial, m_act, HAS_MASK, MP, BLOCK_N, LOGIT_CLAMP)
        out = partial_ptr + (row * parts + part) * (MP + MP * MP)
        tl.store(out + lane, s)
        tl.store(out + MP + lane[:, None] * MP + lane[None, :], ppt)


@triton.jit
def sorted_split_step_kernel(state_ptr, istate_ptr, partial_ptr, info_ptr, status_ptr, parts, tol, max_iter,
                             max_halvings, MP: tl.constexpr, MAX_STEP: tl.constexpr, NEAR_FLOOR: tl.constexpr,
                             SECOND_START_ERROR: tl.constexpr, RIDGE_ULPS: tl.constexpr, CAPPED: tl.constexpr):
    """One program per row: the partials added up, then the single-program kernel's decision on them (the second
    start, a step's acceptance or halving, the next Newton step, the stop), the next thresholds to evaluate and,
    at the stop, the row's info and status."""
    row = tl.program_id(0)
    lane = tl.arange(0, MP)
    phase = tl.load(istate_ptr + row * 5 + 4)
    if phase != SPLIT_DONE:
        base, vec, ppt_ptr = _split_state(state_ptr, row, MP)
        square = lane[:, None] * MP + lane[None, :]
        status = tl.load(istate_ptr + row * 5)
        m_act = tl.load(istate_ptr + row * 5 + 1)
        it = tl.load(istate_ptr + row * 5 + 2)
        tries = tl.load(istate_ptr + row * 5 + 3)
        c = tl.load(vec + lane)
        trial = tl.load(vec + 2 * MP + lane)
        s_t = tl.zeros((MP,), dtype=tl.float32)
        ppt_t = tl.zeros((MP, MP), dtype=tl.float32)
        for part in range(0, parts):
            src = partial_ptr + (row * parts + part) * (MP + MP * MP)
            s_t += tl.load(src + lane)
            ppt_t += tl.load(src + MP + square)
        err_t = _marginal_error(s_t, c, m_act, MP)
        # the evaluated thresholds are taken: the start always; the second start if it fits the masses better; a
        # Newton step's try if it does, or if it is within tol
        take = (phase == SPLIT_START) | (err_t < tl.load(base + 2)) | ((phase == SPLIT_TRIAL) & (err_t <= tol))
        err = tl.where(take, err_t, tl.load(base + 2))
        tz = tl.where(take, trial, tl.load(vec + MP + lane))
        s = tl.where(take, s_t, tl.load(vec + 5 * MP + lane))
        ppt = tl.where(take, ppt_t, tl.load(ppt_ptr + square))
        alpha = tl.load(base + 3) * 0.5
        tl.debug_barrier()  # every thread has read the row's state before any overwrites it
        tl.store(base + 2, err)
        tl.store(vec + MP + lane, tz)
        tl.store(vec + 5 * MP + lane, s)
        tl.store(ppt_ptr + square, ppt)
        # what comes next: another evaluation (the second start, a halved step), or the next Newton step
        second = (phase == SPLIT_START) & (err > SECOND_START_ERROR)
        trying = phase == SPLIT_TRIAL
        tries = tl.where(trying, tries + 1, tries)
        halve = trying & ~take & (tries < max_halvings) & ((err >= NEAR_FLOOR) | (tries < 2))
        step_over = trying & ~halve  # accepted, or no halving helped (the row's rounding floor)
        it = tl.where(step_over, it + 1, it)
        going = tl.where(step_over, (err > tol) & take, (err > tol) & (status == 0))
        if second:
            tl.store(vec + 2 * MP + lane, tz + tl.load(vec + 4 * MP + lane))
        if halve:
            tl.store(base + 3, alpha)
            tl.store(vec + 2 * MP + lane, tz + alpha * tl.load(vec + 3 * MP + lane))
        tl.store(istate_ptr + row * 5 + 2, it)
        tl.store(istate_ptr + row * 5 + 3, tries)
        tl.store(istate_ptr + row * 5 + 4, tl.where(second, SPLIT_SECOND, phase))
        if (phase != SPLIT_TRIAL) & ~second | step_over:  # the next Newton step, or the stop
            if going & (it < max_iter) & (max_halvings > 0):
                step, dtz = _newton_direction(s, ppt, c, m_act, MP, MAX_STEP, RIDGE_ULPS)
                tl.store(base + 3, step)
                tl.store(vec + 3 * MP + lane, dtz)
                tl.store(vec + 2 * MP + lane, tz + step * dtz)
                tl.store(istate_ptr + row * 5 + 3, 0)
                tl.store(istate_ptr + row * 5 + 4, SPLIT_TRIAL)
            else:
                it += tl.where(going & (it < max_iter), 1, 0)  # (max_halvings 0: a step that could not be tried)
                tl.store(info_ptr + row * 2, it.to(tl.float32))
                tl.store(info_ptr + row * 2 + 1, err)
                _store_capped(status_ptr, row, status, it, err, tol, max_iter, CAPPED)
                tl.store(istate_ptr + row * 5 + 2, it)
                tl.store(istate_ptr + row * 5 + 4, SPLIT_DONE)


@triton.jit
def sorted_split_output_kernel(x_ptr, valid_ptr, state_ptr, istate_ptr, out_ptr, n, k, bound, chunk,
                               HAS_MASK: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr,
                               LOGIT_CLAMP: tl.constexpr):
    """Program (row, part): the output over the part's elements, the plan at the row's solution (NaN for a bad
    row, as the single-program kernel)."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    lane = tl.arange(0, MP)
    base, vec, _ = _split_state(state_ptr, row, MP)
    centre = tl.load(base)
    eps = tl.load(base + 1)
    tz = tl.load(vec + MP + lane)
    status = tl.load(istate_ptr + row * 5)
    m_act = tl.load(istate_ptr + row * 5 + 1)
    _store_output(x_ptr, valid_ptr, out_ptr, row, n, k, part * chunk, tl.minimum(n, (part + 1) * chunk), centre, eps,
                  bound, tz, m_act, status, HAS_MASK, MP, BLOCK_N, LOGIT_CLAMP)


@triton.jit
def _output_tile(out_ptr, g_ptr, x_ptr, valid_ptr, row, n, k, start, rest_on, HAS_MASK: tl.constexpr,
                 MP: tl.constexpr, BLOCK_N: tl.constexpr, PLAN_FLOOR: tl.constexpr):
    """Plan tile rebuilt from the sorted output (rest column = 1 - taken; entries at or below PLAN_FLOOR, the
    clamped forward's floor, as 0), the upstream gradient tile, the raw scores with their validity, and how many
    NaN the output tile held (a refused row's output is all NaN)."""
    x, keep = _raw_tile(x_ptr, valid_ptr, row, n, start, HAS_MASK, BLOCK_N)
    offs_n = start + tl.arange(0, BLOCK_N)
    lane = tl.arange(0, MP)
    m2 = keep[:, None] & (lane[None, :] < k)
    p = tl.load(out_ptr + (row * n + offs_n[:, None]) * k + lane[None, :], mask=m2, other=0.0)
    g = tl.load(g_ptr + (row * n + offs_n[:, None]) * k + lane[None, :], mask=m2, other=0.0)
    nans = tl.sum(tl.sum((p != p).to(tl.int32), axis=1), axis=0)
    rest = tl.maximum(1.0 - tl.sum(p, axis=1), 0.0)
    p = tl.where((lane[None, :] == k) & keep[:, None] & (rest_on != 0), rest[:, None], p)
    return tl.where(p > PLAN_FLOOR, p, 0.0), g, x, keep, nans


@triton.jit
def soft_topk_backward_kernel(out_ptr, g_ptr, x_ptr, valid_ptr, eps_ptr, at_ptr, slope_ptr, grad_ptr, grad_eps_ptr, n,
                              k, epsilon, HAS_MASK: tl.constexpr, EPS_PER_ROW: tl.constexpr, EPS_GRAD: tl.constexpr,
                              PAPER: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr,
                              RIDGE_ULPS: tl.constexpr, PLAN_FLOOR: tl.constexpr):
    """dL/dx of the sorted operator from its output (implicit_backward.implicit_grad, divided by eps), and with
    ``EPS_GRAD`` dL/deps (implicit_backward.temperature_grad), for one row: stored, or with ``PAPER`` added to
    dL/dx as the paper scaling's temperature passes it on (:func:`_add_temperature_share`). The temperature:
    ``eps_ptr``'s (``EPS_PER_ROW``) or ``epsilon``."""
    row = tl.program_id(0)
    lane = tl.arange(0, MP)
    n_valid = tl.zeros((), dtype=tl.int32)
    x_sum = tl.zeros((), dtype=tl.float32)
    for start in range(0, n, BLOCK_N):
        x, keep = _raw_tile(x_ptr, valid_ptr, row, n, start, HAS_MASK, BLOCK_N)
        n_valid += tl.sum(keep.to(tl.int32), axis=0)
        x_sum += tl.sum(x, axis=0)
    # The active anchors (solvers.anchor_targets) and the centred anchors y_l = k - l - k/2 (l = 0..k).
    m_act = tl.minimum(n_valid, k) + (n_valid > k).to(tl.int32)
    rest_on = (n_valid > k).to(tl.int32)
    y = tl.where(lane <= k, (k - lane).to(tl.float32) - k / 2.0, 0.0)
    s = tl.zeros((MP,), dtype=tl.float32)
    v = tl.zeros((MP,), dtype=tl.float32)
    ppt = tl.zeros((MP, MP), dtype=tl.float32)
    nans = tl.zeros((), dtype=tl.int32)
    for start in range(0, n, BLOCK_N):
        p, g, x, keep, tile_nans = _output_tile(out_ptr, g_ptr, x_ptr, valid_ptr, row, n, k, start, rest_on,
                                                HAS_MASK, MP, BLOCK_N, PLAN_FLOOR)
        nans += tile_nans
        g_bar = tl.sum(p * g, axis=1)
        v += tl.sum(p * (g - g_bar[:, None]), axis=0)
        s += tl.sum(p, axis=0)
        ppt += tl.sum(p[:, :, None] * p[:, None, :], axis=0)
    w = _solve_free(s, ppt, v, m_act, MP, RIDGE_ULPS)
    if EPS_PER_ROW:
        eps = tl.load(eps_ptr + row)
    else:
        eps = epsilon
    x_mean = x_sum / tl.maximum(n_valid, 1).to(tl.float32)
    moment = tl.zeros((), dtype=tl.float32)  # sum_i dL/dx_i (x_i - mean x): dL/deps = -moment / eps
    for start in range(0, n, BLOCK_N):
        p, g, x, keep, _ = _output_tile(out_ptr, g_ptr, x_ptr, valid_ptr, row, n, k, start, rest_on, HAS_MASK, MP,
                                        BLOCK_N, PLAN_FLOOR)
        y_bar = tl.sum(p * y[None, :], axis=1)
        grad = tl.where(keep, tl.sum(p * (y[None, :] - y_bar[:, None]) * (g - w[None, :]), axis=1) / eps, 0.0)
        moment = _store_gradient_tile(grad_ptr, row, n, start, grad, x, keep, x_mean, nans, moment, EPS_GRAD, BLOCK_N)
    if EPS_GRAD:
        _store_temperature_grad(grad_ptr, grad_eps_ptr, at_ptr, slope_ptr, row, n, moment, eps, nans, PAPER)


@triton.jit
def _scores_tile(x_ptr, valid_ptr, row, n, start, centre, eps, bound, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Normalised scores u (BLOCK_N,) of elements start..start+BLOCK_N of ``row`` and their validity."""
    x, keep = _raw_tile(x_ptr, valid_ptr, row, n, start, HAS_MASK, BLOCK_N)
    u = tl.minimum(tl.maximum(tl.div_rn(x - centre, eps), -bound), bound)
    return tl.where(keep, u, 0.0), keep


@triton.jit
def _sigmoid_pair(z):
    """sigmoid(z) and sigmoid(-z) = 1 - sigmoid(z), each to its own relative precision, from e^{-|z|} (which
    never overflows)."""
    e = tl.exp(-tl.abs(z))
    r = 1.0 / (1.0 + e)
    return tl.where(z >= 0, r, e * r), tl.where(z >= 0, e * r, r)


@triton.jit
def _root_f(complement, k, unselected, side):
    """f = sum_i A_i - k from what :func:`_sigmoid_sums` gave: the selected side, or with ``complement`` the
    unselected one (whose mass is ``unselected`` = n_valid - k)."""
    return tl.where(complement, unselected - side, side - k)


@triton.jit
def _sigmoid_sums(x_ptr, valid_ptr, row, n, centre, eps, bound, tau, complement, HAS_MASK: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """sum_i A_i (with ``complement``, sum_i (1 - A_i)) and sum_i A_i (1 - A_i) over the valid elements,
    A = sigmoid(u - tau)."""
    side = tl.zeros((), dtype=tl.float32)
    slope = tl.zeros((), dtype=tl.float32)
    for start in range(0, n, BLOCK_N):
        u, keep = _scores_tile(x_ptr, valid_ptr, row, n, start, centre, eps, bound, HAS_MASK, BLOCK_N)
        s, s_neg = _sigmoid_pair(u - tau)
        a = tl.where(keep, s, 0.0)
        side += tl.sum(tl.where(keep, tl.where(complement, s_neg, s), 0.0), axis=0)
        slope += tl.sum(a * (1.0 - a), axis=0)
    return side, slope


@triton.jit
def _order_key(x):
    """int32 keys in the order of the float32 scores x (-0.0 just below +0.0): negative floats, whose bits read
    as negative integers in the reverse order, get their magnitude bits flipped."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _kth_largest(x_ptr, valid_ptr, row, n, kk, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    """The ``kk``-th (>= 1) and ``kk+1``-th largest valid scores of ``row`` (ties counted, as in a sorted list;
    the second ``-inf`` past the valid ones): a bisection on the scores' order keys, the largest key ``K`` with
    at least ``kk`` valid keys >= K -- 32 streaming passes whatever ``kk`` is (a pass per distinct value, as
    :func:`_row_top` takes, would be up to ``kk`` + 1) -- then one pass for the next score. (A row with fewer
    than ``kk`` valid scores gets its smallest; with none, NaN: the caller substitutes.)"""
    lo = tl.full((), -2147483648, tl.int64)  # count(key >= lo) >= kk holds for lo = the smallest key
    hi = tl.full((), 2147483647, tl.int64)
    for _ in range(32):  # the key range, 2^32, halves per pass
        mid = (lo + hi + 1) >> 1
        count = tl.zeros((), dtype=tl.int32)
        for start in range(0, n, BLOCK_N):
            x, keep = _raw_tile(x_ptr, valid_ptr, row, n, start, HAS_MASK, BLOCK_N)
            count += tl.sum((keep & (_order_key(x).to(tl.int64) >= mid)).to(tl.int32), axis=0)
        lo = tl.where(count >= kk, mid, lo)
        hi = tl.where(count >= kk, hi, mid - 1)
    key = lo.to(tl.int32)
    kth = tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)
    at_or_above = tl.zeros((), dtype=tl.int32)
    below = tl.full((), float("-inf"), tl.float32)
    for start in range(0, n, BLOCK_N):
        x, keep = _raw_tile(x_ptr, valid_ptr, row, n, start, HAS_MASK, BLOCK_N)
        higher = _order_key(x) >= key
        at_or_above += tl.sum((keep & higher).to(tl.int32), axis=0)
        below = tl.maximum(below, tl.max(tl.where(keep & ~higher, x, float("-inf")), axis=0))
    return kth, tl.where(at_or_above > kk, kth, below)


@triton.jit
def soft_topk_unsorted_forward_kernel(x_ptr, valid_ptr, eps_ptr, at_ptr, slope_ptr, out_ptr, info_ptr, status_ptr,
                                      n, k, bound, tol, max_iter, anchor_top, epsilon, HAS_MASK: tl.constexpr,
                                      PAPER: tl.constexpr, EPS_PER_ROW: tl.constexpr, BLOCK_N: tl.constexpr,
                                      LOG_STEP_FRACTION: tl.constexpr, SATURATION: tl.constexpr,
                                      BAD_NAN: tl.constexpr, BAD_INF: tl.constexpr, BAD_SCALE: tl.constexpr,
                                      CAPPED: tl.constexpr):
    """The unsorted operator of one row from its raw scores (soft_topk_cpu.c's unsorted forward): the checks,
    the temperature (``PAPER``: the paper scaling's, written to eps/at/slope; else read from ``eps_ptr``, with
    ``EPS_PER_ROW``, or ``epsilon``), the
    centre x_(k), the hard-assignment start (solvers.unsorted_start), then solvers.newton_sigmoid_root:
    safeguarded Newton on f(tau) = sum_i sigmoid(u_i - tau) - k inside [u_min + shift, u_max + shift], in log
    space from the tail."""
    row = tl.program_id(0)
    n_valid, status, top0, lowest, eps = _scan_and_temperature(x_ptr, valid_ptr, eps_ptr, at_ptr, slope_ptr,
                                                               row, n, anchor_top, epsilon, HAS_MASK,
                                                               PAPER, EPS_PER_ROW, BLOCK_N, BAD_NAN, BAD_INF,
                                                               BAD_SCALE)
    # The centre x_(k) (the smallest valid score when fewer than k are valid; 0 for an empty row) and the next.
    above, below = _kth_largest(x_ptr, valid_ptr, row, n, tl.maximum(tl.minimum(n_valid, k), 1), HAS_MASK, BLOCK_N)
    centre = tl.where((n_valid > 0) & (tl.abs(above) < float("inf")), above, 0.0)
    solve = (n_valid > k) & (status == 0)  # a bad row is reported, not solved
    # The bracket and the two starts (solvers.unsorted_start): the normalisation is monotone, so the bracket's
    # ends come from the extreme scores; shift = log((n - k) / k).
    shift = tl.where(solve, tl.log(tl.maximum(n_valid - k, 1).to(tl.float32)) - tl.log(k * 1.0), 0.0)
    lo = tl.minimum(tl.maximum(tl.div_rn(lowest - centre, eps), -bound), bound) + shift
    hi = tl.minimum(tl.maximum(tl.div_rn(top0 - centre, eps), -bound), bound) + shift
    u_above = tl.minimum(tl.maximum(tl.div_rn(above - centre, eps), -bound), bound)
    u_below = tl.minimum(tl.maximum(tl.div_rn(below - centre, eps), -bound), bound)
    tau = tl.where(solve, _hard_boundary(u_above, u_below, SATURATION), 0.0)
    scale = tl.maximum(tl.minimum(k, n_valid - k), 1).to(tl.float32)
    log_step = k * 1.0 <= LOG_STEP_FRACTION * n_valid.to(tl.float32)  # Newton in log space from the tail
    log_k = tl.log(k * 1.0)
    # f from the unselected side where 2k > n_valid (solvers.newton_sigmoid_root says why)
    complement = 2 * k > n_valid
    unselected = (n_valid - k).to(tl.float32)
    side, slope = _sigmoid_sums(x_ptr, valid_ptr, row, n, centre, eps, bound, tau, complement, HAS_MASK, BLOCK_N)
    side2, slope2 = _sigmoid_sums(x_ptr, valid_ptr, row, n, centre, eps, bound, tau + shift, complement, HAS_MASK,
                                  BLOCK_N)
    f = _root_f(complement, k, unselected, side)
    f2 = _root_f(complement, k, unselected, side2)
    better = tl.abs(f2) < tl.abs(f)
    tau = tl.where(better, tau + shift, tau)
    f = tl.where(better, f2, f)
    slope = tl.where(better, slope2, slope)
    err = tl.where(solve, tl.abs(f) / scale, 0.0)
    it = tl.full((), 0, tl.int32)
    going = (err > tol) & solve
    while going & (it < max_iter):
        lo = tl.where(f > 0, tl.maximum(lo, tau), lo)  # f decreases in tau: the root is above
        hi = tl.where(f < 0, tl.minimum(hi, tau), hi)
        d = tl.maximum(slope, FLT_TINY)
        mass_now = f + k
        step = tl.where(log_step, tau + (tl.log(mass_now) - log_k) * mass_now / d, tau + f / d)
        inside = (step > lo) & (step < hi) & (step == step) & (tl.abs(step) < float("inf"))
        nxt = tl.where(inside, step, 0.5 * (lo + hi))
        side, slope = _sigmoid_sums(x_ptr, valid_ptr, row, n, centre, eps, bound, nxt, complement, HAS_MASK, BLOCK_N)
        stuck = nxt == tau  # the step no longer moves tau: the row's rounding floor
        tau = nxt
        f = _root_f(complement, k, unselected, side)
        err = tl.abs(f) / scale
        it += 1
        going = (err > tol) & (stuck == 0)
    tl.store(info_ptr + row * 2, it.to(tl.float32))
    tl.store(info_ptr + row * 2 + 1, err)
    _store_capped(status_ptr, row, status, it, err, tol, max_iter, CAPPED)
    for start in range(0, n, BLOCK_N):
        u, keep = _scores_tile(x_ptr, valid_ptr, row, n, start, centre, eps, bound, HAS_MASK, BLOCK_N)
        s, _ = _sigmoid_pair(u - tau)
        a = tl.where(solve, s, 1.0)
        offs_n = start + tl.arange(0, BLOCK_N)
        a = tl.where(status == 0, tl.where(keep, a, 0.0), float("nan"))  # a bad row: NaN
        tl.store(out_ptr + row * n + offs_n, a, mask=offs_n < n)


@triton.jit
def paper_temperature_kernel(x_ptr, valid_ptr, eps_ptr, at_ptr, slope_ptr, n, anchor_top, epsilon,
                             HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    """The paper scaling's temperature of one row alone (:func:`_paper_temperature`)."""
    row = tl.program_id(0)
    _, _, _, hi, lo, hi_at, lo_at = _row_scan(x_ptr, valid_ptr, row, n, HAS_MASK, BLOCK_N)
    eps, at, slope = _paper_temperature(hi, lo, hi_at, lo_at, anchor_top, epsilon)
    tl.store(at_ptr + row, at.to(tl.int64))
    tl.store(slope_ptr + row, slope)
    tl.store(eps_ptr + row, eps)


@triton.jit
def soft_topk_unsorted_backward_kernel(out_ptr, g_ptr, x_ptr, valid_ptr, eps_ptr, at_ptr, slope_ptr, grad_ptr,
                                       grad_eps_ptr, n, epsilon, HAS_MASK: tl.constexpr, EPS_PER_ROW: tl.constexpr,
                                       EPS_GRAD: tl.constexpr, PAPER: tl.constexpr, BLOCK_N: tl.constexpr):
    """dL/dx = a_i (G_i - sum_j G_j a_j / sum_j a_j) / eps, a = A(1 - A) (implicit_backward.sigmoid_grad), over the valid
    entries of the raw scores x; with ``EPS_GRAD`` also dL/deps (implicit_backward.temperature_grad), stored or
    with ``PAPER`` added to dL/dx (:func:`_add_temperature_share`). The temperature: ``eps_ptr``'s
    (``EPS_PER_ROW``) or ``epsilon``."""
    row = tl.program_id(0)
    num = tl.zeros((), dtype=tl.float32)
    den = tl.zeros((), dtype=tl.float32)
    n_valid = tl.zeros((), dtype=tl.int32)
    nans = tl.zeros((), dtype=tl.int32)  # a refused row's output is all NaN: so is its gradient
    x_sum = tl.zeros((), dtype=tl.float32)
    for start in range(0, n, BLOCK_N):
        x, keep = _raw_tile(x_ptr, valid_ptr, row, n, start, HAS_MASK, BLOCK_N)
        offs_n = start + tl.arange(0, BLOCK_N)
        a = tl.load(out_ptr + row * n + offs_n, mask=keep, other=0.0)
        g = tl.load(g_ptr + row * n + offs_n, mask=keep, other=0.0)
        nans += tl.sum((a != a).to(tl.int32), axis=0)
        w = a * (1.0 - a)
        num += tl.sum(g * w, axis=0)
        den += tl.sum(w, axis=0)
        n_valid += tl.sum(keep.to(tl.int32), axis=0)
        x_sum += tl.sum(x, axis=0)
    mean_g = num / tl.maximum(den, FLT_TINY)
    if EPS_PER_ROW:
        eps = tl.load(eps_ptr + row)
    else:
        eps = epsilon
    x_mean = x_sum / tl.maximum(n_valid, 1).to(tl.float32)
    moment = tl.zeros((), dtype=tl.float32)  # sum_i dL/dx_i (x_i - mean x): dL/deps = -moment / eps
    for start in range(0, n, BLOCK_N):
        x, keep = _raw_tile(x_ptr, valid_ptr, row, n, start, HAS_MASK, BLOCK_N)
        offs_n = start + tl.arange(0, BLOCK_N)
        a = tl.load(out_ptr + row * n + offs_n, mask=keep, other=0.0)
        g = tl.load(g_ptr + row * n + offs_n, mask=keep, other=0.0)
        grad = tl.where(keep, a * (1.0 - a) * (g - mean_g) / eps, 0.0)
        moment = _store_gradient_tile(grad_ptr, row, n, start, grad, x, keep, x_mean, nans, moment, EPS_GRAD, BLOCK_N)
    if EPS_GRAD:
        _store_temperature_grad(grad_ptr, grad_eps_ptr, at_ptr, slope_ptr, row, n, moment, eps, nans, PAPER)


def padded_anchors(m: int) -> int:
    return max(2, triton.next_power_of_2(m))


def block_n(n: int, mp: int) -> int:
    """Elements per streamed block: keep the (BLOCK_N, MP, MP) outer-product tile around 16K values."""
    return max(16, min(triton.next_power_of_2(n), 16384 // (mp * mp)))


def warps_for(block: int, mp: int) -> int:
    """Warps per program: 8 once the (BLOCK_N, MP, MP) tile reaches 16K values (faster at the beam shape on an
    H100: docs/results/operator_speed.md, ``scripts/gpu/triton_tuning.py``), else 4."""
    return 8 if block * mp * mp >= 16384 else 4


def _temperature(x, eps, paper, placeholder):
    """The temperature arguments of a forward launch: (eps, at, slope -- what :func:`temperature_outputs` returns
    --, the tensor for ``eps_ptr``, anchor_top, epsilon, EPS_PER_ROW). ``eps``: a (rows,) tensor, a number (every
    row's), or None with ``paper``."""
    per_row = paper is None and isinstance(eps, torch.Tensor)
    if paper is None and not per_row:
        return eps, None, None, placeholder, 0.0, float(eps), False
    eps, at, slope, anchor_top, epsilon = temperature_outputs(x, eps, paper)
    return eps, at, slope, eps, anchor_top, epsilon, per_row


def _backward_temperature(eps, at, slope, eps_grad, placeholder):
    """The temperature arguments of a backward launch: (eps_ptr's tensor, epsilon, at_ptr's, slope_ptr's,
    EPS_PER_ROW, EPS_GRAD, PAPER). ``eps`` a (rows,) tensor or a number; ``at``/``slope`` given: the paper
    scaling's share of dL/dx added in the kernel (dL/deps is then not returned)."""
    per_row = isinstance(eps, torch.Tensor)
    paper = at is not None
    return (eps if per_row else placeholder, 0.0 if per_row else float(eps), at if paper else placeholder,
            slope if paper else placeholder, per_row, bool(eps_grad) or paper, paper)


@ensure_contiguous
def forward(x, mask, eps, k, bound, tol, max_iter, paper=None, max_halvings=MAX_HALVINGS, block=None,
            num_warps=None, parts=None):
    """Launch the sorted forward on raw scores ``x`` (rows, n) float32 (``-inf`` excluded), the caller's ``mask``
    (rows, n) bool or None, and the temperature: a per-row ``eps`` (rows,), one number for every row, or
    ``paper = (anchor_top, epsilon)``, the paper scaling's parameters (``eps`` None: computed). Returns (out
    (rows, n, k), info (rows, 2), status (rows,) int32 -- ``kernel_interface.REFUSAL_BITS`` and ``CAPPED`` --,
    eps, at, slope); ``at`` and ``slope`` are None without ``paper``. ``block``/``num_warps``: launch parameters
    (default: :func:`block_n`, :func:`warps_for`); ``parts``: programs per row (default :func:`split_parts`; more
    than one: the split solve, :func:`_split_forward`)."""
    rows, n = x.shape
    mp = padded_anchors(k + 1)
    block = block or block_n(n, mp)
    out = torch.empty((rows, n, k), dtype=torch.float32, device=x.device)
    info = torch.empty((rows, 2), dtype=torch.float32, device=x.device)
    status = torch.empty((rows,), dtype=torch.int32, device=x.device)
    eps, at, slope, eps_arg, anchor_top, epsilon, per_row = _temperature(x, eps, paper, info)
    parts = parts or split_parts(rows, n, block, x.device)
    if parts > 1 and n > 0:
        _split_forward(x, mask, eps_arg, at, slope, out, info, status, k, bound, tol, max_iter, max_halvings,
                       anchor_top, epsilon, paper is not None, per_row, mp, block, num_warps, parts)
        return out, info, status, eps, at, slope
    soft_topk_forward_kernel[(rows,)](
        x, mask if mask is not None else x, eps_arg, at if at is not None else info,
        slope if slope is not None else info, out, info, status, n, k, float(bound), float(tol), int(max_iter),
        int(max_halvings), float(anchor_top), float(epsilon), HAS_MASK=mask is not None, PAPER=paper is not None,
        EPS_PER_ROW=per_row, MP=mp, BLOCK_N=block, num_warps=num_warps or warps_for(block, mp),
        SATURATION=SATURATION, CAPPED=CAPPED, **REFUSAL_BITS, **KERNEL_CONSTANTS)
    return out, info, status, eps, at, slope


def split_parts(rows: int, n: int, block: int, device: torch.device) -> int:
    """Programs per row of the sorted forward: one, unless the rows are too few to keep half of the GPU's SMs busy
    and long enough to give each program at least four blocks; then enough to fill about two programs per SM."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if rows >= sms // 2:
        return 1
    return max(1, min(triton.cdiv(n, 4 * block), (2 * sms) // max(rows, 1)))


def _split_forward(x, mask, eps_arg, at, slope, out, info, status, k, bound, tol, max_iter, max_halvings,
                   anchor_top, epsilon, paper, per_row, mp, block, num_warps, parts):
    """The sorted forward with ``parts`` programs per row (the split kernels above): the start, then rounds of
    an evaluation (rows x parts programs) and a step (one per row) until every row has stopped -- asked every
    ``SPLIT_ROUNDS`` rounds --, then the output. Writes out, info, status (and eps, at, slope with ``paper``)."""
    rows, n = x.shape
    chunk = triton.cdiv(triton.cdiv(n, parts), block) * block  # (whole blocks: no block straddles two parts)
    parts = triton.cdiv(n, chunk)
    state = torch.zeros((rows, SPLIT_SCALARS.value + 6 * mp + mp * mp), dtype=torch.float32, device=x.device)
    istate = torch.zeros((rows, 5), dtype=torch.int32, device=x.device)
    partial = torch.empty((rows, parts, mp + mp * mp), dtype=torch.float32, device=x.device)
    valid = mask if mask is not None else x
    warps = num_warps or warps_for(block, mp)
    consts = dict(HAS_MASK=mask is not None, MP=mp, BLOCK_N=block, num_warps=warps,
                  LOGIT_CLAMP=KERNEL_CONSTANTS["LOGIT_CLAMP"])
    sorted_split_start_kernel[(rows,)](
        x, valid, eps_arg, at if at is not None else info, slope if slope is not None else info, state, istate, n, k,
        float(bound), float(anchor_top), float(epsilon), HAS_MASK=mask is not None, PAPER=paper, EPS_PER_ROW=per_row,
        MP=mp, BLOCK_N=block, num_warps=warps, SATURATION=SATURATION, **REFUSAL_BITS)
    step_consts = {name: KERNEL_CONSTANTS[name] for name in ("MAX_STEP", "NEAR_FLOOR", "SECOND_START_ERROR",
                                                             "RIDGE_ULPS")}
    # every round moves every going row by one evaluation: this many rounds stop every row
    for _ in range(0, 2 + max(int(max_iter), 0) * max(int(max_halvings), 0) + SPLIT_ROUNDS, SPLIT_ROUNDS):
        for _ in range(SPLIT_ROUNDS):
            sorted_split_evaluate_kernel[(rows, parts)](x, valid, state, istate, partial, n, float(bound), chunk,
                                                        **consts)
            sorted_split_step_kernel[(rows,)](state, istate, partial, info, status, parts, float(tol), int(max_iter),
                                              int(max_halvings), MP=mp, CAPPED=CAPPED, **step_consts)
        if not bool((istate[:, 4] != SPLIT_DONE.value).any()):  # (one read back)
            break
    sorted_split_output_kernel[(rows, parts)](x, valid, state, istate, out, n, k, float(bound), chunk, **consts)


@ensure_contiguous
def backward(out, grad_out, x, mask, eps, k, eps_grad, block=None, num_warps=None, at=None, slope=None):
    """Launch the sorted backward: dL/dx (rows, n) from the output ``out`` (rows, n, k), ``grad_out`` like it,
    the raw scores ``x`` and ``mask`` of the forward and its temperature ``eps`` (a tensor or a number); and
    dL/deps (rows,) when ``eps_grad``, else None. ``at``/``slope`` (the paper scaling's, from the forward): the
    temperature's share added to dL/dx instead, in the same launch (None returned for dL/deps)."""
    rows, n = x.shape
    mp = padded_anchors(k + 1)
    block = block or block_n(n, mp)
    grad = torch.empty((rows, n), dtype=torch.float32, device=x.device)
    eps_arg, epsilon, at_arg, slope_arg, per_row, eps_grad, paper = _backward_temperature(eps, at, slope, eps_grad,
                                                                                          grad)
    grad_eps = torch.empty((rows,), dtype=torch.float32, device=x.device) if eps_grad and not paper else None
    soft_topk_backward_kernel[(rows,)](
        out, grad_out, x, mask if mask is not None else x, eps_arg, at_arg, slope_arg, grad,
        grad_eps if grad_eps is not None else grad, n, k, epsilon, HAS_MASK=mask is not None, EPS_PER_ROW=per_row,
        EPS_GRAD=eps_grad, PAPER=paper, MP=mp, BLOCK_N=block, num_warps=num_warps or warps_for(block, mp),
        **BACKWARD_KERNEL_CONSTANTS)
    return grad, grad_eps


def unsorted_block(n: int) -> int:
    return max(16, min(triton.next_power_of_2(n), 1024))


@ensure_contiguous
def unsorted_forward(x, mask, eps, k, bound, tol, max_iter, paper=None):
    """Launch the unsorted forward on raw scores: the arguments and results of :func:`forward`, the output
    (rows, n)."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=torch.float32, device=x.device)
    info = torch.empty((rows, 2), dtype=torch.float32, device=x.device)
    status = torch.empty((rows,), dtype=torch.int32, device=x.device)
    eps, at, slope, eps_arg, anchor_top, epsilon, per_row = _temperature(x, eps, paper, info)
    soft_topk_unsorted_forward_kernel[(rows,)](
        x, mask if mask is not None else x, eps_arg, at if at is not None else info,
        slope if slope is not None else info, out, info, status, n, k, float(bound), float(tol), int(max_iter),
        float(anchor_top), float(epsilon), HAS_MASK=mask is not None, PAPER=paper is not None, EPS_PER_ROW=per_row,
        BLOCK_N=unsorted_block(n), SATURATION=SATURATION, CAPPED=CAPPED, **REFUSAL_BITS,
        **UNSORTED_KERNEL_CONSTANTS)
    return out, info, status, eps, at, slope


@ensure_contiguous
def unsorted_backward(out, grad_out, x, mask, eps, k, eps_grad, at=None, slope=None):
    """Launch the unsorted backward: the arguments and results of :func:`backward` (``k`` unused: the gradient
    does not depend on it)."""
    rows, n = x.shape
    grad = torch.empty((rows, n), dtype=torch.float32, device=x.device)
    eps_arg, epsilon, at_arg, slope_arg, per_row, eps_grad, paper = _backward_temperature(eps, at, slope, eps_grad,
                                                                                          grad)
    grad_eps = torch.empty((rows,), dtype=torch.float32, device=x.device) if eps_grad and not paper else None
    soft_topk_unsorted_backward_kernel[(rows,)](
        out, grad_out, x, mask if mask is not None else x, eps_arg, at_arg, slope_arg, grad,
        grad_eps if grad_eps is not None else grad, n, epsilon, HAS_MASK=mask is not None, EPS_PER_ROW=per_row,
        EPS_GRAD=eps_grad, PAPER=paper, BLOCK_N=unsorted_block(n))
    return grad, grad_eps


@ensure_contiguous
def paper_temperature(x, mask, anchor_top, epsilon):
    """Launch the paper-scaling temperature (the same arguments and results as ``cpu_kernels.paper_temperature``:
    ``eps``, ``at`` int64, ``slope``, each (rows,))."""
    rows, n = x.shape
    eps, at, slope, _, _ = temperature_outputs(x, None, (anchor_top, epsilon))
    has_mask = mask is not None
    paper_temperature_kernel[(rows,)](x, mask if has_mask else x, eps, at, slope, n, float(anchor_top),
                                      float(epsilon), HAS_MASK=has_mask, BLOCK_N=unsorted_block(n))
    return eps, at, slope
