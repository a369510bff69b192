r"""SOFT top-k and sorted SOFT top-k (Xie et al., NeurIPS 2020): the public operator.

Definition (the one place this package states it)
-------------------------------------------------
For one row of scores :math:`x_1..x_n` (the valid ones: finite and not masked), anchors
:math:`y_0 > \dots > y_{m-1}` one unit apart, and target masses :math:`c_l`, solve the entropic OT problem

.. math::  \min_{\Gamma \ge 0} \sum_{il} \Gamma_{il}\,\tfrac12 (x_i - y_l)^2 + \varepsilon\,\Gamma_{il}\log\Gamma_{il}
           \quad\text{s.t.}\quad \textstyle\sum_l \Gamma_{il} = 1,\ \sum_i \Gamma_{il} = c_l,

(the paper's problem (4) with :math:`n\Gamma` in place of :math:`\Gamma` and half its cost). Its solution is
:math:`\Gamma_{il} = \operatorname{softmax}_l((x_i y_l + h_l)/\varepsilon)`, so ``epsilon`` is a temperature in
the units of the scores:

* ``sorted=False`` -- anchors ``(1, 0)``, masses ``(k, n-k)``. Output ``A_i = Gamma_i0 = sigmoid((x_i - tau)/eps)``
  with ``tau`` such that ``sum_i A_i = k``; shape of ``scores``.
* ``sorted=True`` -- anchors ``k, k-1, ..., 0``, masses ``1, ..., 1, n-k``. Output ``A[..., i, l] = Gamma_il``
  for ranks ``l < k`` (rank 0 = largest), shape ``scores.shape + (k,)``; every rank column sums to 1.

``scaling="paper"`` reproduces the authors' normalisation: their cost :math:`(x_i - y_l)^2` over anchors
``{0..K}`` (``K = k`` sorted, ``1`` unsorted) divided by its maximum ``M``. That is the problem above with
temperature :math:`\varepsilon M / 2`, with ``M`` taken **per row** over valid entries (the authors take it
over the batch, which makes rows depend on each other). Unlike theirs, the backward differentiates through
``M`` too, so gradients are those of the function actually computed.

Masking, degenerate rows, dtypes
--------------------------------
``-inf`` scores (``+inf`` with ``largest=False``) and ``mask == False`` entries are excluded: they get exactly 0 and zero gradient and do not
count in ``n``. A row with ``n_valid <= k`` valid entries gets 1 on every valid entry (unsorted) or the soft
sort of its valid entries over ranks ``0..n_valid-1`` (sorted; ranks ``>= n_valid`` are 0). An all-masked row
is all zeros. NaN or ``+inf`` scores (``ops.BadScoresError``; with ``check_errors=False`` a NaN row of output
instead), ``k`` outside ``1..n``, an ``epsilon`` that is not a number > 0 within the range of the type it is computed in,
and non-float scores raise.
float16/bfloat16 are computed in float32 and returned in their dtype; float64 stays float64. Second derivatives
(``create_graph=True``, then a backward through the gradient) are those of the PyTorch path, ``backend="torch"``,
with ``scaling="none"``; elsewhere differentiating the gradient raises (a fused kernel's backward is not
differentiable again; the paper temperature's share of the gradient is first-order).
"""
import warnings
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from softtopk_fairseq import defaults
from softtopk_fairseq.ops import backends, cpu_kernels, implicit_backward
from softtopk_fairseq.ops.arguments import (check_flags, check_selection, compute_dtype, count_problems, flag_problems,
                                            mask_along_last, solver_option_problems, temperature_problems)
from softtopk_fairseq.ops.backends import SolveOptions
from softtopk_fairseq.ops.kernel_interface import CAPPED, REFUSED

METHODS = ("newton", "sinkhorn")
BACKENDS = backends.NAMES
SCALINGS = ("none", "paper")
DEFAULT_TOL = {torch.float32: defaults.TOL_FLOAT32, torch.float64: defaults.TOL_FLOAT64}


class SolverInfo(NamedTuple):
    """Per-row solver report, shaped like the scores without ``dim``."""

    iterations: Tensor
    error: Tensor  # max relative error of the anchor masses
    converged: Tensor  # error <= tol
    temperature: Tensor  # the temperature the row was solved at, in score units (effective_epsilon; detached)
    # stopped at max_iter unconverged: what check_errors=True warns about (never with tol=0, which asks for
    # every iteration up to max_iter)
    capped: Tensor


# --------------------------------------------------------------------------------------------------------
# The op on 2-D (rows, n) tensors. Which backend computes it (backends.py) is chosen once per call; the op itself
# never asks which one it holds. Two wrappers of the same backend calls: a custom op registered with
# torch.library (_solve, _gradients), so that torch.compile sees one opaque node, and -- in eager mode, where
# the custom op's dispatch and autograd wrapper cost ~100 us per call, as much as the whole solve of a 64x1000
# batch -- a plain autograd.Function that also computes the temperature (_solve_with_temperature).
# --------------------------------------------------------------------------------------------------------


def _with_fallback(backend: str, impl: backends.Backend, call):
    """``call(impl)``; when a fused kernel fails to build or launch under ``backend="auto"``, warn once and
    run ``call`` on the PyTorch path instead (a backend named explicitly raises)."""
    try:
        return call(impl)
    except backends.KernelError as e:
        if backend != "auto":
            raise
        return call(backends.fall_back(impl, str(e)))


def _solve(x: Tensor, mask: Optional[Tensor], eps: Tensor, opts: SolveOptions, backend: str) -> Tuple[Tensor, Tensor]:
    impl = backends.select(x, opts.method, backend)
    return _with_fallback(backend, impl, lambda b: b.solve(x, mask, eps, opts))


def _gradients(grad_out: Tensor, out: Tensor, x: Tensor, mask: Optional[Tensor], eps: Tensor, opts: SolveOptions,
               backend: str, eps_grad: bool, eager: bool = True) -> Tuple[Tensor, Tensor]:
    """dL/dx and dL/deps by the backend that runs the call; in eager mode, not differentiable again unless by
    tensor operations (:func:`first_order_only`; under torch.compile, AOTAutograd refuses double backward
    itself)."""
    def call(b: backends.Backend):
        grad_x, grad_eps = b.gradients(grad_out, out, x, mask, eps, opts, eps_grad)
        if b.differentiable_backward or not eager:
            return grad_x, grad_eps
        return first_order_only(_kernel_backward(b), out, grad_x, grad_eps)

    return _with_fallback(backend, backends.select(x, "newton", backend), call)


def first_order_only(message: str, out: Tensor, *grads: Tensor) -> Tuple[Tensor, ...]:
    """Gradients ``grads`` of the op's output ``out`` that are not differentiable again, as they are -- or, while a
    graph of the backward is being built (``create_graph=True``: a second derivative may follow), aliases whose own
    backward raises ``message``, tied to the scores' graph through ``out``: a second derivative through them would
    be wrong without a word (0 through a kernel). (``torch.autograd.function.once_differentiable`` ties its error
    to the incoming gradients only, which need not depend on the scores.)"""
    if not torch.is_grad_enabled():
        return grads
    error = torch._C._functions.DelayedError(message.encode(), len(grads) + 1)
    aliases = error(*[g.detach() for g in grads], out)
    return aliases[:-1]


def _kernel_backward(impl: backends.Backend) -> str:
    return (f"soft_topk: the backward of backend={impl.name!r} is a kernel, not differentiable again: for second "
            "derivatives use backend='torch'")


def _paper_backward(op: str) -> str:
    return (f"{op}: no second derivatives with scaling='paper' (the temperature's share of the gradient is taken "
            "to first order); use scaling='none' with backend='torch'")


# The custom op's arguments are what torch.library's schema takes (tensors and scalars): the options spelled out.
@torch.library.custom_op("softtopk_fairseq::soft_topk", mutates_args=())
def _soft_topk_op(x: Tensor, mask: Optional[Tensor], eps: Tensor, k: int, sorted: bool, tol: float, max_iter: int,
                  method: str, backend: str, check_errors: bool) -> Tuple[Tensor, Tensor]:
    return _solve(x, mask, eps, SolveOptions(k, sorted, tol, max_iter, method, check_errors), backend)


@_soft_topk_op.register_fake
def _(x, mask, eps, k, sorted, tol, max_iter, method, backend, check_errors):
    shape = (*x.shape, k) if sorted else x.shape
    return x.new_empty(shape), x.new_empty((x.shape[0], 2))


@torch.library.custom_op("softtopk_fairseq::soft_topk_backward", mutates_args=())
def _soft_topk_backward_op(grad_out: Tensor, out: Tensor, x: Tensor, mask: Optional[Tensor], eps: Tensor, k: int,
                           sorted: bool, backend: str, eps_grad: bool, check_errors: bool) -> Tuple[Tensor, Tensor]:
    # (tol, max_iter and method do not enter the backward)
    return _gradients(grad_out, out, x, mask, eps, SolveOptions(k, sorted, 0.0, 0, "newton", check_errors), backend,
                      eps_grad, eager=False)


@_soft_topk_backward_op.register_fake
def _(grad_out, out, x, mask, eps, k, sorted, backend, eps_grad, check_errors):
    return x.new_empty(x.shape), x.new_empty(x.shape[:1])


def _setup_context(ctx, inputs, output):
    x, mask, eps, k, sorted, tol, max_iter, method, backend, check_errors = inputs
    ctx.save_for_backward(output[0], x, mask, eps)
    ctx.k, ctx.sorted, ctx.backend, ctx.check_errors = k, sorted, backend, check_errors


def _backward_fn(ctx, grad_out, grad_info):
    out, x, mask, eps = ctx.saved_tensors
    grad_x, grad_eps = _soft_topk_backward_op(grad_out.contiguous(), out, x, mask, eps, ctx.k, ctx.sorted,
                                              ctx.backend, ctx.needs_input_grad[2], ctx.check_errors)
    return grad_x, None, grad_eps, None, None, None, None, None, None, None


_soft_topk_op.register_autograd(_backward_fn, setup_context=_setup_context)


def _add_paper_temperature_grad(grad_x: Tensor, grad_eps: Tensor, at: Tensor, slope: Tensor) -> Tensor:
    """``grad_x`` (rows, n; in place, unless a graph of the backward is being built) plus dL/deps * d eps / d x:
    under the paper scaling the temperature depends on one entry per row, ``at``, with derivative ``slope`` there
    (:class:`_PaperTemperature`)."""
    add = grad_x.scatter_add if torch.is_grad_enabled() else grad_x.scatter_add_
    return add(-1, at.unsqueeze(-1), implicit_backward.paper_temperature_grad(grad_eps, slope).unsqueeze(-1))


class _SoftTopKEager(torch.autograd.Function):
    """The same op in eager mode (see above): ``_solve`` forward, ``_gradients`` backward, with the per-row
    temperature computed in the same node by the same backend (:func:`_solve_with_temperature`). Under the
    paper scaling, d eps / d x has one nonzero entry per row: the backward adds dL/deps * d eps / d x there,
    in place (:func:`_add_paper_temperature_grad`), instead of a separate autograd node."""

    @staticmethod
    def forward(ctx, x, mask, epsilon, scaling, opts, backend):
        out, info, eps, at, slope = _solve_with_temperature(x, mask, epsilon, scaling, opts, backend)
        # eps is returned for SolverInfo only: dL/deps * d eps / d x is added by this node's backward.
        ctx.mark_non_differentiable(info, eps)
        ctx.set_materialize_grads(False)  # no zero gradients built for info and eps (two launches per call)
        ctx.save_for_backward(out, x, mask, eps, at, slope)
        ctx.opts, ctx.backend = opts, backend
        return out, info, eps

    @staticmethod
    def backward(ctx, grad_out, grad_info, grad_eps_reported):
        if grad_out is None:  # not materialised (set_materialize_grads): the loss does not depend on out
            return (None,) * 6
        out, x, mask, eps, at, slope = ctx.saved_tensors
        paper = at is not None
        grad_x, grad_eps = _gradients(grad_out.contiguous(), out, x, mask, eps, ctx.opts, ctx.backend, paper)
        if paper:
            grad_x, = first_order_only(_paper_backward("soft_topk"), out,
                                        _add_paper_temperature_grad(grad_x, grad_eps, at, slope))
        return grad_x, None, None, None, None, None


class _Fused(torch.autograd.Function):
    """The operator's thin path: float32 scores without a mask (``largest``, by Newton), one fused launch each way
    (``backends.FusedBackend.thin_forward`` / ``thin_backward``: the C kernels, or the Triton kernels) with nothing
    around it -- the work that :class:`_SoftTopKEager` does through the backend interface (checks, the paper
    scaling's temperature, the solve; dL/dx with the temperature's share) without its tensor operations and
    per-row temperature tensor, for the most common calls, whose time on small problems is otherwise mostly
    Python, dispatch and (on a GPU) launches. Returns the output and (status bits, info, eps) of the forward
    (:func:`_fused`)."""

    @staticmethod
    def forward(ctx, x, k, sorted, epsilon, paper, tol, max_iter, impl, check_errors):
        out, bits, info, eps, at, slope = _fused_forward(impl, x, k, sorted, epsilon, paper, tol, max_iter,
                                                         check_errors)
        ctx.save_for_backward(out, x if impl.thin_saves_scores(sorted, paper) else None, eps, at, slope)
        ctx.k, ctx.sorted, ctx.epsilon, ctx.impl = k, sorted, epsilon, impl
        return out, (bits, info, eps)  # (a Python object: autograd passes it through untracked)

    @staticmethod
    def backward(ctx, grad_out, grad_report):
        out, x, eps, at, slope = ctx.saved_tensors
        grad = ctx.impl.thin_backward(out, grad_out.contiguous(), x, ctx.k, ctx.sorted, ctx.epsilon, eps, at, slope)
        message = _paper_backward("soft_topk") if at is not None else _kernel_backward(ctx.impl)
        return first_order_only(message, out, grad)[0], None, None, None, None, None, None, None, None


class _RefusedUnchecked(Exception):
    """A thin call without ``check_errors`` whose backend reports refused scores for the whole call (the C kernels:
    one status, read for free): the general path answers it, with NaN on the refused rows alone."""


def _fused_forward(impl, x, k, sorted, epsilon, paper, tol, max_iter, check_errors):
    """``impl.thin_forward`` and its status read as bits (with ``check_errors``, or where reading it costs nothing:
    on a device, the one value read back); refused scores raise (:class:`_RefusedUnchecked` without
    ``check_errors``)."""
    out, status, info, eps, at, slope = impl.thin_forward(x, k, sorted, epsilon, paper, tol, max_iter)
    bits = impl.status_bits(status) if check_errors or impl.status_on_host else 0
    if bits & REFUSED:
        if not check_errors:
            raise _RefusedUnchecked()
        backends.raise_for_status_bits(bits)
    return out, bits, info, eps, at, slope


def _fused(impl: backends.FusedBackend, x: Tensor, k: int, sorted: bool, epsilon: float, paper: bool, tol: float,
           max_iter: int, check_errors: bool = True):
    """The operator on contiguous float32 scores ``x`` (any shape; selected along the last dimension) on the thin
    path of ``impl`` (:class:`_Fused`; without autograd when no gradient is asked for): (out, status bits, info,
    eps) -- the bits 0 without ``check_errors``; info (rows, 2), on CPU a view of this thread's scratch, read at
    once; eps the paper scaling's temperatures, else None."""
    if x.requires_grad and torch.is_grad_enabled():
        out, (bits, info, eps) = _Fused.apply(x, k, sorted, epsilon, paper, tol, max_iter, impl, check_errors)
        return out, bits, info, eps
    out, bits, info, eps, _, _ = _fused_forward(impl, x, k, sorted, epsilon, paper, tol, max_iter, check_errors)
    return out, bits, info, eps


def _thin_route(scores, k, dim, epsilon, sorted, scaling, backend) -> Optional[backends.FusedBackend]:
    """The fused backend that runs a call to :func:`soft_topk` -- unmasked, ``largest``, by Newton, at the default
    tolerance and without info -- as it is (:func:`_fused`), or None: valid arguments (anything else takes the
    general path, which checks them and says what is wrong), float32 contiguous scores selected along their last
    dimension, not under torch.compile, and a backend with a thin path for them (``backends.thin_route``; on CPU
    with the paper scaling only unsorted)."""
    if torch.compiler.is_compiling():  # (first: what follows is not for Dynamo to trace)
        return None
    if not (type(scores) in _PLAIN_TENSORS and scores.dtype is torch.float32 and scores.dim() > 0
            and type(dim) is int and (dim == -1 or dim == scores.dim() - 1)
            and type(k) is int and 0 < k <= scores.shape[-1]
            and type(epsilon) in (float, int) and _FLOAT32.tiny <= epsilon <= _FLOAT32.max and scaling in ("none", "paper")
            and scores.is_contiguous() and scores.numel() > 0):
        return None
    impl = backends.thin_route(scores, backends.resolve(backend))
    if impl is backends.CPU and sorted and scaling == "paper":
        return None
    return impl


_PLAIN_TENSORS = (Tensor, nn.Parameter)
_FLOAT32 = torch.finfo(torch.float32)  # (the thin route's epsilon range: temperature_problems' in float32)


def _solve_with_temperature(x: Tensor, mask: Optional[Tensor], epsilon: float, scaling: str, opts: SolveOptions,
                            backend: str):
    """The per-row temperature and the op's forward, by one backend: (out, info, eps, at, slope); ``at`` and
    ``slope`` (where the paper scaling's maximal cost sits, d eps / d x there) are None for a constant
    temperature."""

    def call(impl: backends.Backend):
        if scaling == "paper":
            return impl.solve_paper(x, mask, epsilon, opts)
        eps = _constant_temperature(x, epsilon)
        return (*impl.solve(x, mask, eps, opts), eps, None, None)

    return _with_fallback(backend, backends.select(x, opts.method, backend), call)


def _constant_temperature(x: Tensor, epsilon: float) -> Tensor:
    """``epsilon`` for every row of (rows, n) scores (``scaling="none"``)."""
    return torch.full(x.shape[:1], float(epsilon), dtype=x.dtype, device=x.device)


# --------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------


def _warn_if_capped(info: Tensor, tol: float, max_iter: int) -> None:
    """Warn when some row stopped at ``max_iter`` above ``tol`` (one synchronisation on a device: the count of
    iterations read back). tol=0 asks for every iteration up to max_iter: nothing to warn. Rows may also stop early
    at their rounding floor (float32 scores far from 0 relative to epsilon carry only ~1e-7 * |x| / epsilon of
    information); that is reported in the info, not warned about. (The row-wise test only when some row reached
    max_iter.)"""
    if tol > 0 and info.numel() and float(info[:, 0].max()) >= max_iter:
        capped = (info[:, 0] >= max_iter) & (info[:, 1] > tol)
        if bool(capped.any()):
            warnings.warn(
                f"soft_topk: {int(capped.sum())} row(s) hit max_iter={max_iter} with marginal error up to "
                f"{float(info[:, 1].max()):.3g} > tol={tol:g} (raise max_iter or tol)",
                RuntimeWarning, stacklevel=3)


def _validate(scores, k, epsilon, scaling, method, backend, mask, dim, tol, max_iter):
    check_selection("soft_topk", scores, k, dim, "epsilon", epsilon, mask)
    for problem in _option_problems(scaling, method, backend, tol, max_iter):
        raise ValueError(f"soft_topk: {problem}")


def _option_problems(scaling, method, backend, tol, max_iter) -> List[str]:
    """What is wrong with the options of :func:`soft_topk` that do not depend on the scores."""
    problems = solver_option_problems(tol, max_iter)
    if scaling not in SCALINGS:
        problems.append(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    if method not in METHODS:
        problems.append(f"method must be one of {METHODS}, got {method!r}")
    if backend not in BACKENDS:
        problems.append(f"backend must be one of {BACKENDS}, got {backend!r}")
    elif backend in backends.FUSED and method != "newton":
        problems.append(f"the fused kernels (backend={backend!r}) solve by Newton's method, not method={method!r}; "
                        "use backend='torch' or 'auto' for it")
    return problems


class _PaperTemperature(torch.autograd.Function):
    """The paper scaling's per-row temperature ``epsilon * M / 2``, ``M = max_i max(x_i^2, (x_i - K)^2)`` over
    the valid entries (``K``: the top anchor; ``epsilon`` itself for a row with ``M = 0`` or no valid entry).
    The cost is convex in ``x``, so ``M`` sits at the row's largest or smallest valid score: two reductions,
    and a derivative with one nonzero entry per row -- a handful of operations instead of an autograd graph
    over the whole row (this runs on every call). The backend computes ``(eps, at, slope)``: the temperature,
    the entry where ``M`` sits and d eps / d x there (``Backend.paper_temperature``)."""

    @staticmethod
    def forward(ctx, x: Tensor, mask: Optional[Tensor], anchor_top: float, epsilon: float,
                impl: backends.Backend) -> Tensor:
        eps, at, slope = impl.paper_temperature(x, mask, anchor_top, epsilon)
        ctx.save_for_backward(at, slope, eps)
        ctx.shape = x.shape
        return eps

    @staticmethod
    def backward(ctx, grad_eps):
        at, slope, eps = ctx.saved_tensors
        grad_x = _add_paper_temperature_grad(grad_eps.new_zeros(ctx.shape), grad_eps, at, slope)
        return first_order_only(_paper_backward("effective_epsilon"), eps, grad_x)[0], None, None, None, None


def _row_temperature(x: Tensor, mask: Optional[Tensor], k: int, epsilon: float, sorted: bool, scaling: str,
                     backend: str, method: str = "newton") -> Tensor:
    """Per-row temperature in score units of (rows, n) scores (already negated when largest=False; ``-inf`` and
    ``mask == False`` entries excluded), computed by the backend that runs the call."""
    if scaling != "paper":
        return _constant_temperature(x, epsilon)
    # Under torch.compile the PyTorch version, which dynamo traces (the fused kernels are opaque calls).
    impl = backends.TORCH if torch.compiler.is_compiling() else backends.select(x, method, backend)
    return _with_fallback(backend, impl, lambda b: _PaperTemperature.apply(x, mask, backends.top_anchor(k, sorted),
                                                                           float(epsilon), b))


def effective_epsilon(scores: Tensor, k: int, *, dim: int = -1, epsilon: float = defaults.EPSILON,
                      sorted: bool = False, largest: bool = True, scaling: str = defaults.OPERATOR_SCALING,
                      mask: Optional[Tensor] = None) -> Tensor:
    """The temperature, in score units, that :func:`soft_topk` uses for each row (shape of ``scores``
    without ``dim``): ``epsilon`` itself, or with ``scaling="paper"`` ``epsilon * max_cost / 2`` of the row
    (over its valid entries: not ``-inf`` -- ``+inf`` with ``largest=False`` -- and not masked), in the type the
    operator computes in (float32 for float16/bfloat16 scores). With ``scaling="paper"`` differentiable in ``scores``
    (``detach`` it for bounds; a constant otherwise); ``softmax_k_times`` uses it for its temperature
    and callers that reason about the solution (e.g. bounds on pruned candidates) need it. Its arguments are
    checked as :func:`soft_topk` checks them; a row with a NaN, or an infinity on the selected side that the mask
    keeps (what :func:`soft_topk` refuses with ``ops.BadScoresError``), gets a NaN temperature, without an error or
    a read back: a relaxation that divides by it hands that row's NaN on. (Scores too large for the paper scaling
    get its limit, an infinite temperature.)"""
    check_selection("effective_epsilon", scores, k, dim, "epsilon", epsilon, mask)
    check_flags("effective_epsilon", sorted=sorted, largest=largest)
    if scaling not in SCALINGS:
        raise ValueError(f"effective_epsilon: scaling must be one of {SCALINGS}, got {scaling!r}")
    x = scores.to(compute_dtype(scores.dtype)).movedim(dim, -1)
    if not largest:
        x = -x
    rows = x.reshape(-1, x.shape[-1])
    row_mask = _row_mask(mask, scores.shape, dim)
    eps = _row_temperature(rows, row_mask, k, epsilon, sorted, scaling, backends.resolve("auto"))
    bad = backends.bad_rows(rows, backends.valid_entries(rows, row_mask))
    return torch.where(bad, torch.nan, eps).reshape(x.shape[:-1])


class _DivideByTemperature(torch.autograd.Function):
    """``where(valid, x / T, -inf)`` per row; see :func:`divide_by_temperature`."""

    @staticmethod
    def forward(ctx, x: Tensor, temperature: Tensor, valid: Tensor) -> Tensor:
        largest = torch.finfo(x.dtype).max
        quotient = x / temperature.unsqueeze(-1)
        # (a finite score's quotient clamped; an infinite one -- a bad score -- stays as it is, to be refused)
        quotient = torch.where(torch.isinf(x), quotient, quotient.clamp(-largest, largest))
        scaled = torch.where(valid, quotient, -torch.inf)
        ctx.save_for_backward(scaled, temperature, valid)
        return scaled

    @staticmethod
    def backward(ctx, grad):
        scaled, temperature, valid = ctx.saved_tensors
        grad = torch.where(valid, grad, 0.0)
        grad_x = grad / temperature.unsqueeze(-1)
        # d(x / T)/dT = -(x / T) / T, in that order: T * T underflows for a tiny T, and 0 * inf would be NaN.
        grad_t = -torch.linalg.vecdot(grad, torch.where(valid, scaled, 0.0)) / temperature
        return grad_x, grad_t, None


def divide_by_temperature(scores: Tensor, temperature: Tensor, valid: Optional[Tensor] = None, *,
                          check_errors: bool = True) -> Tensor:
    """``scores / T`` along the last dimension, ``T`` (rows,) per row (e.g. :func:`effective_epsilon`),
    differentiable in both; entries not ``valid`` (default: the ``-inf`` ones, the op's rule,
    ``backends.valid_entries``) are ``-inf`` with zero gradient. A NaN or ``+inf`` score stays as it is, for the
    relaxation it is handed to to refuse (it is not an excluded entry: that would hide a broken model). Safe where
    the naive division is not: an excluded ``-inf`` never enters it (``d(x / T)/dT`` there is ``inf * 0 = NaN``),
    ``dL/dT = -sum_i dL/du_i u_i / T`` with ``u = x / T`` stays finite where ``T**2`` underflows, and a finite
    score whose quotient leaves the float range is clamped to +-``finfo.max`` (a valid entry stays one -- an
    overflow to ``+inf`` would read as a bad score, to ``-inf`` as an excluded one -- and a zero ``dL/du`` there
    is no ``0 * inf``); the gradient is that of ``x / T`` throughout. For relaxations that take the temperature as
    a division of the scores (softmax-k-times, the perturbed top-k at ``sigma = 1``). ``check_errors``: refuse a
    temperature <= 0 (one value read back from the device; not while compiling); ``False`` for a caller whose
    temperatures are :func:`effective_epsilon`'s and that divides by them again and again."""
    if not isinstance(temperature, Tensor) or temperature.shape != scores.shape[:-1]:
        shape = tuple(temperature.shape) if isinstance(temperature, Tensor) else type(temperature).__name__
        raise ValueError(f"divide_by_temperature: temperature must be a tensor shaped like the scores without their "
                         f"last dimension, {tuple(scores.shape[:-1])}, got {shape}")
    if not (scores.is_floating_point() and temperature.is_floating_point()):
        raise TypeError(f"divide_by_temperature: scores and temperature must be floating point, got {scores.dtype} "
                        f"and {temperature.dtype}")
    if valid is None:
        valid = backends.valid_entries(scores, None)
    elif not (isinstance(valid, Tensor) and valid.dtype == torch.bool and valid.shape == scores.shape):
        what = f"{valid.dtype} {tuple(valid.shape)}" if isinstance(valid, Tensor) else type(valid).__name__
        raise ValueError(f"divide_by_temperature: valid must be a bool tensor shaped like the scores, "
                         f"{tuple(scores.shape)}, got {what}")
    # (a NaN temperature -- effective_epsilon's for a bad row -- passes: the row's NaN is handed on. Not checked
    # while compiling, where reading the check back would break the graph.)
    if check_errors and not torch.compiler.is_compiling() and bool((temperature <= 0).any()):
        bad = temperature[temperature <= 0][0].item()
        raise ValueError(f"divide_by_temperature: temperatures must be > 0, got {bad} (a row's effective_epsilon is)")
    return _DivideByTemperature.apply(scores, temperature, valid)


def _row_mask(mask: Optional[Tensor], shape: torch.Size, dim: int) -> Optional[Tensor]:
    """The caller's mask, broadcast to the scores' ``shape`` and laid out as their (rows, n) view: a copy, which
    the op may keep for its backward while the caller reuses (or edits) its own."""
    if mask is None:
        return None
    return mask_along_last(mask, shape, dim).reshape(-1, shape[dim]).clone(memory_format=torch.contiguous_format)


def soft_topk(scores: Tensor, k: int, *, dim: int = -1, epsilon: float = defaults.EPSILON, sorted: bool = False,
              largest: bool = True, mask: Optional[Tensor] = None, scaling: str = defaults.OPERATOR_SCALING,
              tol: Optional[float] = None, max_iter: Optional[int] = None, method: str = defaults.SOLVER_METHOD,
              backend: str = "auto", check_errors: bool = True, return_info: bool = False):
    r"""Differentiable top-k indicator of ``scores`` along ``dim`` (see the module docstring for the math).

    Args:
        scores: float tensor, any shape; ``-inf`` entries are excluded (``+inf`` with ``largest=False``); a NaN,
            or an infinity on the selected side that ``mask`` keeps, is refused (``ops.BadScoresError``).
        k: number of elements to select, ``1 <= k <= scores.shape[dim]``.
        dim: dimension to select along.
        epsilon: entropic temperature, in the units of ``scores`` (``scaling="none"``).
        sorted: ``False`` -> output like ``scores``, values in [0, 1] summing to ``k`` along ``dim``.
            ``True`` -> output ``scores.shape + (k,)`` (``dim`` keeps its place, ranks are last):
            ``A[..., i, l]`` is the soft indicator that element ``i`` has rank ``l`` (0 = largest).
        largest: select the largest (``True``) or the smallest elements, like ``torch.topk``.
        mask: optional bool tensor broadcastable to ``scores``; ``False`` entries are excluded.
        scaling: ``"none"`` or ``"paper"`` (divide the cost by its per-row maximum, as the authors do).
        tol: stop when every anchor's mass is within ``tol`` (relative) of its target. Default:
            ``defaults.TOL_FLOAT32`` in float32 (also for float16/bfloat16 inputs), ``defaults.TOL_FLOAT64`` in
            float64.
        max_iter: iteration cap (default: ``defaults.MAX_ITER`` of the method). A warning is issued when a row
            hits it unconverged.
        method: ``"newton"`` (damped Newton on the semi-dual, default) or ``"sinkhorn"`` (the paper's
            Algorithm 1 in the log domain; with ``tol=0`` it runs exactly ``max_iter`` iterations).
        backend: ``"auto"`` (fused kernels for float32 tensors -- Triton on CUDA when triton is
            installed, C on CPU when a C compiler is (see ``cpu_kernels``) -- PyTorch otherwise),
            ``"torch"``, ``"triton"`` or ``"cpu"`` (both float32 and Newton only; ``"triton"`` with
            ``TRITON_INTERPRET=1`` also runs on CPU tensors, slowly -- for tests).
        check_errors: ``True``: raise on refused scores and warn when a row hits ``max_iter``, each check one
            synchronisation on a GPU (a value read back). ``False``, like the ``check_errors`` of
            ``torch.linalg``'s ``*_ex`` functions: nothing is read back -- a refused row's output and gradient are
            NaN instead (as a NaN in the scores would make them in a PyTorch operation), and a capped row is only
            reported in the info (``return_info``: iterations ``max_iter``, not converged). For callers that run
            many calls per step on a GPU and look at the result once (e.g. the soft beam search's loss).
        return_info: also return a :class:`SolverInfo` (iterations, marginal error, converged, temperature,
            capped) per row.

    Gradients use the closed-form implicit backward (App. H): O(n k) time and memory, no iterates kept.
    """
    impl = (_thin_route(scores, k, dim, epsilon, sorted, scaling, backend)
            if mask is None and largest is True and return_info is False and type(sorted) is bool
            and type(check_errors) is bool and method == "newton" and tol is None and max_iter is None
            and backend in backends.NAMES else None)
    if impl is not None:  # the most common calls, as thin as the hard top-k's: one launch each way
        try:
            out, bits, info, _ = _fused(impl, scores, k, sorted, float(epsilon), scaling == "paper",
                                        defaults.TOL_FLOAT32, defaults.MAX_ITER["newton"], check_errors)
            if check_errors and bits & CAPPED:
                _warn_if_capped(info, defaults.TOL_FLOAT32, defaults.MAX_ITER["newton"])
            return out
        except _RefusedUnchecked:  # NaN rows for the refused ones, the others solved: the general path's work
            pass
        except backends.KernelError as e:  # a Triton launch failed: under "auto", the general path falls back
            if backends.resolve(backend) != "auto":
                raise
            backends.fall_back(impl, str(e))
    check_flags("soft_topk", sorted=sorted, largest=largest, check_errors=check_errors, return_info=return_info)
    _validate(scores, k, epsilon, scaling, method, backend, mask, dim, tol, max_iter)
    dim = dim % scores.dim()
    in_dtype, dtype = scores.dtype, compute_dtype(scores.dtype)
    x = scores if in_dtype == dtype else scores.to(dtype)
    if dim != scores.dim() - 1:
        x = x.movedim(dim, -1)
    batch_shape, n = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, n)
    if not largest:  # excluded entries are -inf from here on
        x = -x
    row_mask = _row_mask(mask, scores.shape, dim)
    backend = backends.resolve(backend)
    if tol is None:
        tol = DEFAULT_TOL[dtype]
    if max_iter is None:
        max_iter = defaults.MAX_ITER[method]
    compiling = torch.compiler.is_compiling()
    capped_somewhere = True  # (unknown: read from the info)
    if compiling:
        eps = _row_temperature(x, row_mask, k, epsilon, sorted, scaling, backend, method)
        out, info = _soft_topk_op(x, row_mask, eps, k, sorted, float(tol), int(max_iter), method, backend,
                                  bool(check_errors))
        eps = eps.detach()
    elif ((not sorted or scaling == "none") and row_mask is None and largest and check_errors and method == "newton"
          and x.dtype == torch.float32 and x.device.type == "cpu" and backends.on_cpu_kernels(backend)):
        out, bits, info, eps = _fused(backends.CPU, x if x.is_contiguous() else x.contiguous(), k, bool(sorted),
                                      float(epsilon), scaling == "paper", float(tol), int(max_iter))
        info = info.clone() if return_info else info  # (a scratch view)
        capped_somewhere = bool(bits & CAPPED)
        if return_info and eps is None:
            eps = _constant_temperature(x, epsilon)
    else:
        opts = SolveOptions(k, sorted, float(tol), int(max_iter), method, bool(check_errors))
        out, info, eps = _SoftTopKEager.apply(x, row_mask, float(epsilon), scaling, opts, backend)
    if check_errors and not compiling and capped_somewhere:
        _warn_if_capped(info, tol, max_iter)
    if sorted:
        out = out.reshape(*batch_shape, n, k).movedim(-2, dim)
    else:
        out = out.reshape(*batch_shape, n)
        out = out if dim == scores.dim() - 1 else out.movedim(-1, dim)
    out = out if out.dtype == in_dtype else out.to(in_dtype)
    if return_info:
        iters = info[:, 0].reshape(batch_shape)
        err = info[:, 1].reshape(batch_shape)
        converged = err <= tol
        capped = (iters >= max_iter) & ~converged if tol > 0 else torch.zeros_like(converged)
        return out, SolverInfo(iters, err, converged, eps.reshape(batch_shape), capped)
    return out


class SoftTopK(nn.Module):
    """``nn.Module`` wrapper of :func:`soft_topk` with fixed ``k``, ``epsilon`` and options, checked when it is
    built (what depends on the scores -- ``k`` against their size, ``epsilon`` against the type they are computed
    in -- when it is called)."""

    def __init__(self, k: int, epsilon: float = defaults.EPSILON, *, dim: int = -1, sorted: bool = False,
                 largest: bool = True, scaling: str = defaults.OPERATOR_SCALING, tol: Optional[float] = None,
                 max_iter: Optional[int] = None, method: str = defaults.SOLVER_METHOD, backend: str = "auto"):
        super().__init__()
        problems = (count_problems("k", k) + temperature_problems("epsilon", epsilon, torch.float64)
                    + flag_problems(sorted=sorted, largest=largest) + _option_problems(scaling, method, backend, tol,
                                                                                        max_iter))
        if problems:
            raise ValueError("SoftTopK: " + "; ".join(problems))
        self.k, self.epsilon, self.dim, self.sorted, self.largest = k, epsilon, dim, sorted, largest
        self.scaling, self.tol, self.max_iter, self.method, self.backend = scaling, tol, max_iter, method, backend

    def forward(self, scores: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        return soft_topk(scores, self.k, dim=self.dim, epsilon=self.epsilon, sorted=self.sorted,
                         largest=self.largest, mask=mask, scaling=self.scaling, tol=self.tol,
                         max_iter=self.max_iter, method=self.method, backend=self.backend)

    def extra_repr(self) -> str:
        return f"k={self.k}, epsilon={self.epsilon}, sorted={self.sorted}, largest={self.largest}"
