"""The backends of ``soft_topk``'s op: one interface, chosen once per call (:func:`select`).

* :class:`Backend` -- the interface (abstract): :meth:`~Backend.solve`, :meth:`~Backend.solve_paper`,
  :meth:`~Backend.paper_temperature` and :meth:`~Backend.gradients`, all on (rows, n) scores with ``-inf`` on
  excluded entries and the caller's ``mask`` (bool, or None), and the call's :class:`SolveOptions`.
* :class:`TorchBackend` -- the PyTorch path (``backend="torch"``): any device, float32 or float64, Newton or
  Sinkhorn. It prepares with tensor operations (:meth:`TorchBackend.solve`: the checks, the centre, the start)
  and solves with ``solvers``. The reference the fused backends are tested against.
* :class:`FusedBackend` -- the same Newton solve and closed-form backward in one kernel launch each way, on the
  raw scores, the preparation included (one call each way instead of a few dozen tensor operations, each a
  launch on a GPU); subclasses name their kernel module and when they can run: :class:`CpuBackend`
  (``cpu_kernels``, C, CPU tensors) and :class:`TritonBackend` (``triton_kernels``, CUDA tensors, or CPU tensors
  under ``TRITON_INTERPRET=1`` for the tests).

``soft_topk.py`` keeps the definition, validation and the custom-op registration, and never asks which backend
it holds.

``backend="auto"``: the fused kernels for float32 -- Triton on CUDA, C on CPU -- else the PyTorch path. When
the fused kernels cannot be had (no triton, no C compiler) or a launch fails (a compiler or driver error),
``auto`` warns once, saying why, and uses the PyTorch path; a backend named explicitly raises instead.
"""
import abc
import contextlib
import functools
import os
import re
import threading
import warnings
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from softtopk_fairseq.ops import cpu_kernels, implicit_backward, solvers
from softtopk_fairseq.ops.arguments import BadScoresError, nan_scores, selected_infinity
from softtopk_fairseq.ops.kernel_interface import BAD_INF, BAD_NAN, BAD_SCALE, REFUSED

NAMES = ("auto", "torch", "triton", "cpu")
NAN_SCORES = nan_scores("soft_topk")
INF_SCORES = selected_infinity("soft_topk")
BAD_TEMPERATURE = ("soft_topk: scores too large for scaling='paper' in float32: the temperature (epsilon * max "
                   "cost / 2, the cost squares the scores) is infinite and the scores' range overflows, so the "
                   "normalised scores would be NaN; rescale the scores or use scaling='none'")


class KernelError(RuntimeError):
    """A fused kernel could not be built or launched (the message says why)."""


def top_anchor(k: int, sorted: bool) -> float:
    """The top anchor ``K`` of the paper scaling's cost (anchors 0..K): ``k`` sorted, 1 unsorted."""
    return float(k if sorted else 1)


@dataclass(frozen=True)
class SolveOptions:
    """What one call of the op solves, besides its tensors: ``k``, ``sorted``, the solver's ``tol``,
    ``max_iter`` and ``method``, and ``check_errors`` (raise on refused scores, or NaN rows without reading
    anything back)."""

    k: int
    sorted: bool
    tol: float
    max_iter: int
    method: str = "newton"
    check_errors: bool = True

    @property
    def anchor_top(self) -> float:
        return top_anchor(self.k, self.sorted)

    def checked(self) -> "SolveOptions":
        """The same options with ``check_errors=True``: for a solve whose refused rows were taken out first."""
        return SolveOptions(self.k, self.sorted, self.tol, self.max_iter, self.method, True)


class Backend(abc.ABC):
    """The interface of a backend (module docstring); ``name`` is the ``backend=`` value that names it."""

    name = ""
    # whether :meth:`gradients` is differentiable itself (second derivatives): tensor operations are, a kernel is not
    differentiable_backward = False

    @abc.abstractmethod
    def solve(self, x: Tensor, mask: Optional[Tensor], eps: Tensor, opts: SolveOptions) -> Tuple[Tensor, Tensor]:
        """The op's forward on (rows, n) scores ``x`` (``-inf`` where excluded), the caller's ``mask`` (rows, n)
        (or None) and the per-row temperature ``eps``: the output ((rows, n, k) sorted, (rows, n) not) and the
        info (rows, 2) = iterations, marginal error. Refused scores (NaN, +inf on a valid entry, an infinite
        temperature over a range that overflows) raise, or without ``opts.check_errors`` come out as NaN rows,
        the others solved as they would be alone."""

    @abc.abstractmethod
    def solve_paper(self, x: Tensor, mask: Optional[Tensor], epsilon: float, opts: SolveOptions):
        """The op's forward at the paper scaling's temperature: (out, info, eps, at, slope), as
        :meth:`paper_temperature` then :meth:`solve`."""

    @abc.abstractmethod
    def paper_temperature(self, x: Tensor, mask: Optional[Tensor], anchor_top: float,
                          epsilon: float) -> Tuple[Tensor, Tensor, Tensor]:
        """The paper scaling's temperature per row (``soft_topk._PaperTemperature`` states it), the index of the
        entry where the row's maximal cost sits and d eps / d x there: (eps, at, slope), each (rows,)."""

    @abc.abstractmethod
    def gradients(self, grad_out: Tensor, out: Tensor, x: Tensor, mask: Optional[Tensor], eps: Tensor,
                  opts: SolveOptions, eps_grad: bool) -> Tuple[Tensor, Tensor]:
        """dL/dx (rows, n) and dL/deps (rows,; zeros unless ``eps_grad``) from the op's output; without
        ``opts.check_errors``, NaN on the rows it refused."""


class _Start(NamedTuple):
    """What :meth:`TorchBackend.solve` prepares before it solves (the fused kernels find it per row)."""

    valid: Tensor      # (rows, n) the entries that take part
    n_valid: Tensor    # (rows,) how many
    centre: Tensor     # (rows,) x_(k), the k-th largest valid score (0 for empty rows)
    bound: float       # the normalised scores' clamp (score_bound)
    u_top: Tensor      # (rows, k + 1) the normalised top-(k+1) valid scores: the starting thresholds


class TorchBackend(Backend):
    """The PyTorch path: checks, centre and start by tensor operations, then ``solvers``; any device and float
    dtype, Newton or Sinkhorn."""

    name = "torch"
    differentiable_backward = True

    def solve(self, x, mask, eps, opts):
        if opts.check_errors:
            return self._solve_checked(x, mask, eps, opts)
        return solve_without_refused(x, mask, eps, lambda x, eps: self._solve_checked(x, mask, eps, opts))

    def _solve_checked(self, x: Tensor, mask: Optional[Tensor], eps: Tensor, opts: SolveOptions):
        """:meth:`solve`, raising on the rows it refuses."""
        k = opts.k
        valid = valid_entries(x, mask)
        n_valid = valid.sum(-1)
        all_valid = bool((n_valid == x.shape[-1]).all())
        top = self.row_top(x, valid, min(k + 1, x.shape[-1]))
        _check_scores(x, top, all_valid, eps, valid)
        kth = (n_valid.clamp(max=k) - 1).clamp_min(0).unsqueeze(-1)
        centre = top.gather(-1, kth).squeeze(-1)  # x_(k), the k-th largest valid score (0 for empty rows)
        centre = torch.where(torch.isfinite(centre), centre, torch.zeros_like(centre))
        bound = score_bound(x.dtype, k)
        u_top = torch.where(torch.isfinite(top), solvers.normalise_scores(top, centre, eps, bound), top)
        return self.forward(x, eps, _Start(valid, n_valid, centre, bound, u_top), opts)

    def solve_paper(self, x, mask, epsilon, opts):
        eps, at, slope = self.paper_temperature(x, mask, opts.anchor_top, epsilon)
        return (*self.solve(x, mask, eps, opts), eps, at, slope)

    def gradients(self, grad_out, out, x, mask, eps, opts, eps_grad):
        valid = valid_entries(x, mask)
        grad_x = self.backward(grad_out, out, valid, eps, opts.k, opts.sorted)
        if not eps_grad:  # a constant temperature (scaling="none"): no dL/deps to form
            grads = grad_x, torch.zeros_like(eps)
        else:
            grads = grad_x, implicit_backward.temperature_grad(grad_x, x, valid, eps)
        return grads if opts.check_errors else refused_gradients(out, grads)

    def paper_temperature(self, x, mask, anchor_top, epsilon):
        valid = valid_entries(x, mask)
        # (the shortcut reads a tensor's value: not while torch.compile traces)
        all_valid = not torch.compiler.is_compiling() and bool(valid.all())
        hi, hi_at = (x if all_valid else torch.where(valid, x, -torch.inf)).max(-1)
        lo, lo_at = (x if all_valid else torch.where(valid, x, torch.inf)).min(-1)
        any_valid = torch.isfinite(hi)  # x itself is finite wherever valid (checked by the op)
        hi, lo = torch.where(any_valid, hi, 0.0), torch.where(any_valid, lo, 0.0)
        # The cost at each extreme, and its derivative d/dv max(v^2, (v - K)^2) there.
        cost_hi = torch.maximum(hi.square(), (hi - anchor_top).square())
        cost_lo = torch.maximum(lo.square(), (lo - anchor_top).square())
        slope_hi = torch.where(hi.square() >= (hi - anchor_top).square(), 2 * hi, 2 * (hi - anchor_top))
        slope_lo = torch.where(lo.square() >= (lo - anchor_top).square(), 2 * lo, 2 * (lo - anchor_top))
        use_hi = cost_hi >= cost_lo
        cost = torch.where(use_hi, cost_hi, cost_lo)
        positive = (cost > 0) & any_valid  # a row without valid entries: M = 0, temperature epsilon
        eps = torch.where(positive, epsilon * cost / 2, torch.full_like(cost, epsilon))
        slope = torch.where(positive, epsilon / 2 * torch.where(use_hi, slope_hi, slope_lo), 0.0)
        return eps, torch.where(use_hi, hi_at, lo_at), slope

    def row_top(self, x: Tensor, valid: Tensor, kk: int) -> Tensor:
        """The ``kk`` largest valid scores of each row, decreasing; ``-inf`` past the valid ones, NaN first."""
        xv = torch.where(valid, x, torch.full((), -torch.inf, dtype=x.dtype, device=x.device))
        return torch.topk(xv, kk, dim=-1).values

    def forward(self, x: Tensor, eps: Tensor, start: _Start, opts: SolveOptions) -> Tuple[Tensor, Tensor]:
        """The operator's output ((rows, n, k) sorted, (rows, n) not) and info (rows, 2) = iterations,
        marginal error, for (rows, n) scores ``x`` normalised per row by ``start.centre`` and ``eps``."""
        k, sorted, tol, max_iter = opts.k, opts.sorted, opts.tol, opts.max_iter
        valid = start.valid
        u = solvers.normalise_scores(x, start.centre, eps, start.bound).masked_fill_(~valid, 0.0)
        if opts.method == "newton" and not sorted:
            return solvers.newton_sigmoid_root(u, valid, k, tol, max_iter, start.u_top)
        y, c = solvers.anchor_targets(start.n_valid, k, sorted, x.dtype)
        if opts.method == "newton":
            p, info = solvers.newton_semi_dual(u, valid, c, tol, max_iter, top=start.u_top)
        else:
            p, info = solvers.sinkhorn(u, valid, y, c, max_iter, tol if tol > 0 else None)
        out = p[:, :k].transpose(-1, -2) if sorted else p[:, 0]
        return out.contiguous(), info

    def backward(self, grad_out: Tensor, out: Tensor, valid: Tensor, eps: Tensor, k: int,
                 sorted: bool) -> Tensor:
        """dL/dx (rows, n) from the output alone (App. H): the plan is rebuilt from ``out``."""
        if not sorted:
            return implicit_backward.sigmoid_grad(out, grad_out, valid) / eps.unsqueeze(-1)
        y, c = solvers.anchor_targets(valid.sum(-1), k, True, out.dtype)
        vf = valid.to(out.dtype)
        taken = out.transpose(-1, -2) * vf.unsqueeze(-2)                 # (rows, k, n)
        rest = (1 - taken.sum(-2)).clamp_min(0) * vf * (c[:, -1:] > 0).to(out.dtype)
        taken, rest = (torch.where(p > solvers.PLAN_FLOOR, p, torch.zeros_like(p)) for p in (taken, rest))
        grad_u = implicit_backward.implicit_grad(taken, rest, grad_out.transpose(-1, -2), y, c)
        return torch.where(valid, grad_u / eps.unsqueeze(-1), torch.zeros_like(grad_u))



class FusedBackend(Backend):
    """Newton forward and closed-form backward in one kernel launch each way, from the raw scores -- the checks,
    the centre, the temperature (the paper scaling's in the same pass) and the start included, which
    :meth:`TorchBackend.solve` prepares with tensor operations (on a GPU those cost more host time than the solve
    itself). Subclasses set ``kernels``, a module with the launchers ``forward`` / ``unsorted_forward`` (x, mask,
    eps, k, bound, tol, max_iter, paper=None) -> (out, info, status, eps, at, slope), ``backward`` /
    ``unsorted_backward`` (out, grad_out, x, mask, eps, k, eps_grad) -> (grad_x, grad_eps or None) and
    ``paper_temperature``; and say where they run and how their forwards report bad scores
    (:meth:`raise_for_status`, :meth:`refusing`)."""

    kernels = None

    def usable(self) -> Optional[str]:
        """None when the kernels can run here, else why not."""
        return None

    @abc.abstractmethod
    def runs_on(self, x: Tensor) -> Optional[str]:
        """None when the kernels take tensors like ``x``, else why not."""

    @abc.abstractmethod
    def auto_device(self, x: Tensor) -> bool:
        """Whether ``backend="auto"`` picks this backend for tensors like ``x`` (float32 ones)."""

    @abc.abstractmethod
    def raise_for_status(self, status) -> None:
        """Raise ValueError on the status a forward launcher returned (``kernel_interface.STATUS_BITS``)."""

    @abc.abstractmethod
    def refusing(self, status, result: Tuple[Tensor, ...], x: Tensor, mask: Optional[Tensor], eps: Tensor,
                 again) -> Tuple[Tensor, ...]:
        """A forward's ``result`` (out first) without ``check_errors``: NaN on the rows ``status`` reports bad,
        which the kernels do not solve. ``again(x, eps)``: the same call on other scores, for a backend that
        cannot tell the bad rows apart without reading them back."""

    def refused_gradients(self, out: Tensor, grads: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
        """``grads`` with NaN on the rows refused without ``check_errors`` (:func:`refused_gradients`)."""
        return refused_gradients(out, grads)

    def _forward(self, x, mask, eps, opts, paper=None):
        forward = self.kernels.forward if opts.sorted else self.kernels.unsorted_forward
        return self._launch(forward, x, mask, eps, opts.k, score_bound(x.dtype, opts.k), opts.tol, opts.max_iter,
                            paper)

    def solve(self, x, mask, eps, opts):
        out, info, status, _, _, _ = self._forward(x, mask, eps, opts)
        if opts.check_errors:
            self.raise_for_status(status)
            return out, info
        return self.refusing(status, (out, info), x, mask, eps, lambda x, eps: self.solve(x, mask, eps,
                                                                                           opts.checked()))

    def solve_paper(self, x, mask, epsilon, opts):
        out, info, status, eps, at, slope = self._forward(x, mask, None, opts, (opts.anchor_top, epsilon))
        if opts.check_errors:
            self.raise_for_status(status)
            return out, info, eps, at, slope
        return self.refusing(status, (out, info, eps, at, slope), x, mask, eps,
                             lambda x, _: self.solve_paper(x, mask, epsilon, opts.checked()))

    def gradients(self, grad_out, out, x, mask, eps, opts, eps_grad):
        backward = self.kernels.backward if opts.sorted else self.kernels.unsorted_backward
        grad_x, grad_eps = self._launch(backward, out, grad_out, x, mask, eps, opts.k, eps_grad)
        grads = grad_x, torch.zeros_like(eps) if grad_eps is None else grad_eps
        return grads if opts.check_errors else self.refused_gradients(out, grads)

    def paper_temperature(self, x, mask, anchor_top, epsilon):
        return self._launch(self.kernels.paper_temperature, x, mask, anchor_top, epsilon)  # (-inf: excluded there)

    def _launch(self, fn, *args):
        return fn(*args)

    # The operator's thin path (soft_topk._Fused): the most common calls -- contiguous float32 scores of any
    # shape, selected along the last dimension, no mask, ``largest`` -- one launch each way with nothing around it.

    def thin_forward(self, x: Tensor, k: int, sorted: bool, epsilon: float, paper: bool, tol: float,
                     max_iter: int):
        """(out, status, info (rows, 2), eps, at, slope): the output (``x.shape``, ``+ (k,)`` sorted), the
        status as the kernels report it (:meth:`status_bits` reads it), and with ``paper`` the paper scaling's
        per-row temperature, else None for all three (every row's is ``epsilon``)."""
        raise NotImplementedError

    def thin_backward(self, out: Tensor, grad_out: Tensor, x: Optional[Tensor], k: int, sorted: bool,
                      epsilon: float, eps: Optional[Tensor], at: Optional[Tensor], slope: Optional[Tensor]) -> Tensor:
        """dL/dx for :meth:`thin_forward`'s output, the paper scaling's share included (``at``/``slope``)."""
        raise NotImplementedError

    def thin_saves_scores(self, sorted: bool, paper: bool) -> bool:
        """Whether :meth:`thin_backward` reads the scores."""
        return True

    # Whether a forward's status is on the host already (no synchronisation to read it).
    status_on_host = False

    def status_bits(self, status) -> int:
        """A forward's status as one int of ``kernel_interface.STATUS_BITS`` (on a device: one value read)."""
        return int(status)


class CpuBackend(FusedBackend):
    """The C kernels (``soft_topk_cpu.c``), compiled on first use; CPU tensors. Their forwards report bad scores
    as one status for the whole call (no synchronisation on CPU)."""

    name = "cpu"
    kernels = cpu_kernels
    status_on_host = True

    def usable(self):
        try:
            cpu_kernels.library()
        except RuntimeError as e:  # no compiler, or it failed: the message says which
            return str(e).removeprefix("soft_topk: ")
        return None

    def runs_on(self, x):
        return None if x.device.type == "cpu" else f"backend='cpu' needs CPU tensors, got {x.device}"

    def auto_device(self, x):
        return x.device.type == "cpu"

    def raise_for_status(self, status):
        raise_for_status_bits(status)

    def thin_forward(self, x, k, sorted, epsilon, paper, tol, max_iter):
        bound = score_bound(torch.float32, k)
        if sorted:  # (the paper scaling sorted takes the general path)
            return cpu_kernels.sorted_fused_forward(x, k, epsilon, bound, tol, max_iter)
        return cpu_kernels.unsorted_fused_forward(x, k, epsilon, (top_anchor(k, False), epsilon) if paper else None,
                                                  bound, tol, max_iter)

    def thin_backward(self, out, grad_out, x, k, sorted, epsilon, eps, at, slope):
        if sorted:
            return cpu_kernels.sorted_fused_backward(out, grad_out, x, epsilon)
        return cpu_kernels.unsorted_fused_backward(out, grad_out, x, eps, epsilon, at, slope)

    def thin_saves_scores(self, sorted, paper):
        return sorted or paper  # (the unsorted gradient at a constant temperature needs only the output)

    def refusing(self, status, result, x, mask, eps, again):
        if not status & REFUSED:  # (CAPPED: the op reads the iteration counts itself)
            return result
        # One status for the whole call, and a bad row can leave its neighbours unsolved (the unsorted kernel
        # solves rows in groups): find the bad rows (CPU tensors: nothing to synchronise) and solve again without.
        return solve_without_refused(x, mask, eps, again)


# The oldest triton the Triton kernels are tested with (3.0, which torch 2.4 pins, fails in them).
TRITON_OLDEST = (3, 6)


def _dotted(version: Tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@functools.lru_cache(maxsize=None)
def _triton_problem() -> Optional[str]:
    """Why the Triton kernels cannot run in this process (triton missing or too old), or None; found once (every
    GPU call asks)."""
    try:
        import triton
    except ImportError as e:
        return f"triton is not installed ({e}); pip install 'triton>={_dotted(TRITON_OLDEST)}'"
    version = tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2])
    if version < TRITON_OLDEST:
        return (f"triton {triton.__version__} is older than {_dotted(TRITON_OLDEST)}, the oldest the kernels are "
                f"tested with (torch {torch.__version__} requires it; torch 2.11 comes with 3.6)")
    return None


class TritonBackend(FusedBackend):
    """The Triton kernels (``triton_kernels.py``); CUDA tensors (CPU tensors under ``TRITON_INTERPRET=1``). Their
    forwards report bad scores per row, read with one synchronisation."""

    name = "triton"

    @property
    def kernels(self):
        from softtopk_fairseq.ops import triton_kernels  # imports triton: only when this backend runs
        return triton_kernels

    def usable(self):
        return _triton_problem()

    def runs_on(self, x):
        if x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1, for tests), got {x.device}"

    def auto_device(self, x):
        return x.is_cuda

    def raise_for_status(self, status):
        _raise_for_row_status(status)

    def refusing(self, status, result, x, mask, eps, again):
        return result  # the kernels write a bad row's output as NaN themselves: nothing to read back, or to launch

    def refused_gradients(self, out, grads):
        return grads  # the backward kernels write NaN where the output is NaN

    def _launch(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # compilation (ptxas, out of resources) or driver errors
            raise KernelError(f"the Triton kernel {fn.__name__} failed: {type(e).__name__}: {e}") from e

    def thin_forward(self, x, k, sorted, epsilon, paper, tol, max_iter):
        n = x.shape[-1]
        launch = self.kernels.forward if sorted else self.kernels.unsorted_forward
        out, info, status, eps, at, slope = self._launch(
            launch, x.view(-1, n), None, None if paper else epsilon, k, score_bound(torch.float32, k), tol, max_iter,
            (top_anchor(k, sorted), epsilon) if paper else None)
        return (out.view(*x.shape, k) if sorted else out.view(x.shape), status, info, eps if paper else None, at,
                slope)

    def thin_backward(self, out, grad_out, x, k, sorted, epsilon, eps, at, slope):
        n = x.shape[-1]
        shape = (-1, n, k) if sorted else (-1, n)
        launch = self.kernels.backward if sorted else self.kernels.unsorted_backward
        grad, _ = self._launch(launch, out.view(shape), grad_out.view(shape), x.view(-1, n), None,
                               epsilon if eps is None else eps, k, False, at=at, slope=slope)
        return grad.view(x.shape)

    def status_bits(self, status):
        # One copy to the host (a synchronisation, no kernel; a copy on CPU tensors too, so that it can be
        # counted there), the rows' bits OR-ed on the host.
        import numpy
        return int(numpy.bitwise_or.reduce(status.to("cpu", copy=True).numpy())) if status.numel() else 0


def valid_entries(x: Tensor, mask: Optional[Tensor]) -> Tensor:
    """Which entries of (rows, n) scores take part: not ``-inf`` (the op's scores are already negated when
    ``largest=False``) and, given a mask, where it is True."""
    valid = x != -torch.inf
    return valid if mask is None else valid & mask


def bad_rows(x: Tensor, valid: Tensor, highest: Optional[Tensor] = None) -> Tensor:
    """(rows,) True on the rows of (rows, n) scores with a NaN anywhere or +inf on a ``valid`` entry (the op's
    scores: already negated when largest=False): the rows ``BadScoresError`` is about, without reading anything
    back. ``highest``: each row's largest valid score, when the caller has it."""
    if highest is None:
        highest = torch.where(valid, x, -torch.inf).amax(-1)
    return torch.isnan(x).any(-1) | (highest == torch.inf)


def refused_rows(x: Tensor, valid: Tensor, eps: Tensor) -> Tensor:
    """(rows,) True on the rows of (rows, n) scores that the op refuses (the fused kernels' status bits, what
    :func:`_check_scores` raises on), found by tensor operations without reading anything back: the
    :func:`bad_rows`, and an infinite temperature ``eps`` with a range of valid scores that overflows."""
    highest = torch.where(valid, x, -torch.inf).amax(-1)
    lowest = torch.where(valid, x, torch.inf).amin(-1)
    return bad_rows(x, valid, highest) | (~(eps < torch.inf) & (highest - lowest == torch.inf))


def solve_without_refused(x: Tensor, mask: Optional[Tensor], eps: Tensor, solve) -> Tuple[Tensor, ...]:
    """``solve(x, eps)`` -- a forward returning (out, ...) -- with the rows the op refuses (:func:`refused_rows`)
    replaced by zeros at temperature 1, a row every backend solves, so that the others are solved as they would
    be alone; then NaN on those rows of ``out``."""
    refused = refused_rows(x, valid_entries(x, mask), eps)
    out, *rest = solve(torch.where(refused.unsqueeze(-1), 0.0, x), torch.where(refused, 1.0, eps))
    return nan_rows(out, refused), *rest


def refused_gradients(out: Tensor, grads: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
    """``grads`` (each (rows, ...)) with NaN on the rows whose output is NaN: the rows refused without
    ``check_errors`` (never a solved one), whatever the backward computed from them -- it reads a NaN plan as an
    empty one."""
    refused = torch.isnan(out.view(out.shape[0], -1)[:, 0])
    return tuple(nan_rows(g, refused) for g in grads)


def nan_rows(out: Tensor, refused: Tensor) -> Tensor:
    """``out`` (rows, ...) with NaN on the ``refused`` rows."""
    return torch.where(refused.view(-1, *(1,) * (out.dim() - 1)), torch.nan, out)


def score_bound(dtype: torch.dtype, k: int) -> float:
    """The normalised scores are clamped to +-this: far-away elements are saturated anyway, and the solvers'
    logits (a few anchors times u) stay finite."""
    return torch.finfo(dtype).max / (8.0 * (k + 2))


def raise_for_status_bits(status: int) -> None:
    """A fused forward's report (``kernel_interface.BAD_NAN`` / ``BAD_INF`` / ``BAD_SCALE`` bits)."""
    if status & BAD_NAN:
        raise BadScoresError(NAN_SCORES)
    if status & BAD_INF:
        raise BadScoresError(INF_SCORES)
    if status & BAD_SCALE:
        raise ValueError(BAD_TEMPERATURE)


def _raise_for_row_status(status: Tensor) -> None:
    """:func:`raise_for_status_bits` on per-row status bits; one synchronisation unless some row is bad."""
    if bool(status.any()):
        raise_for_status_bits(sum(int((status & bit).amax()) for bit in (BAD_NAN, BAD_INF, BAD_SCALE)))


def _check_scores(x: Tensor, top: Tensor, all_valid: bool, eps: Tensor, valid: Tensor) -> None:
    """NaN or +inf among the valid scores shows up first in ``top`` (the row's largest valid scores); a NaN
    under the mask is looked for separately (only when something is masked); an infinite temperature is
    looked at in the same synchronisation, and refused where the row's range overflows (``kernel_interface.BAD_SCALE``)."""
    first = top[:, 0]
    infinite_eps = ~(eps < torch.inf)
    if bool((torch.isnan(first) | (first == torch.inf) | infinite_eps).any()) or (
            not all_valid and bool(torch.isnan(x).any())):
        if bool(torch.isnan(x).any()):  # in the order of the fused kernels' status bits
            raise BadScoresError(NAN_SCORES)
        if bool((first == torch.inf).any()):
            raise BadScoresError(INF_SCORES)
        lowest = torch.where(valid, x, torch.inf).amin(-1)
        if bool((infinite_eps & (first - lowest == torch.inf)).any()):
            raise ValueError(BAD_TEMPERATURE)


TORCH = TorchBackend()
CPU = CpuBackend()
TRITON = TritonBackend()
FUSED = {"cpu": CPU, "triton": TRITON}
_disabled = {}  # fused backend -> why auto no longer picks it (warned once)


def fall_back(impl: FusedBackend, why: str) -> Backend:
    """Stop ``auto`` from picking ``impl`` in this process, warn once saying why; returns the PyTorch path."""
    if impl not in _disabled:
        _disabled[impl] = why
        warnings.warn(f"soft_topk: the fused {impl.name} kernels are not used ({why}); falling back to the "
                      "PyTorch solver (backend='torch')", RuntimeWarning, stacklevel=3)
    return TORCH


def select(x: Tensor, method: str, backend: str) -> Backend:
    """The backend that runs this call; raises ValueError / KernelError when a named one cannot."""
    if backend == "torch" or method != "newton":
        return TORCH
    if backend in FUSED:
        impl = FUSED[backend]
        why = impl.runs_on(x)
        if why is not None:
            raise ValueError(f"soft_topk: {why}")
        why = impl.usable()
        if why is not None:
            raise KernelError(f"soft_topk: backend={backend!r} cannot run: {why}")
        if x.dtype != torch.float32:
            raise ValueError(f"soft_topk: the fused kernels (backend={backend!r}) compute in float32, got "
                             f"{x.dtype}; use backend='torch' for float64")
        return impl
    if x.dtype != torch.float32:
        return TORCH
    for impl in (TRITON, CPU):
        if not impl.auto_device(x) or impl in _disabled:
            continue
        why = impl.usable()
        return impl if why is None else fall_back(impl, why)
    return TORCH


_default = threading.local()


@contextlib.contextmanager
def use_backend(name: str):
    """Within the block, ``soft_topk`` calls that ask for ``backend="auto"`` (all of this package's modules,
    criterions and models do) use ``name`` instead -- e.g. to run a model on the PyTorch path, or to force
    the Triton kernels in a test. Thread-local; nests."""
    if name not in NAMES:
        raise ValueError(f"use_backend: name must be one of {NAMES}, got {name!r}")
    previous = getattr(_default, "name", "auto")
    _default.name = name
    try:
        yield
    finally:
        _default.name = previous


def thin_route(x: Tensor, backend: str) -> Optional[FusedBackend]:
    """The fused backend that runs a call with ``backend`` (already :func:`resolve`-d) on float32 scores like
    ``x`` on the operator's thin path (``soft_topk._Fused``), or None: the C kernels as :func:`on_cpu_kernels`
    says; the Triton kernels when named (where they run) or, under ``auto``, for CUDA tensors while they have
    not failed. Anything else -- and every error -- takes the general path, which says what is wrong."""
    if x.is_cpu and on_cpu_kernels(backend):
        return CPU
    if backend == "triton" or (backend == "auto" and x.is_cuda and TRITON not in _disabled):
        return TRITON if TRITON.runs_on(x) is None and TRITON.usable() is None else None
    return None


def on_cpu_kernels(backend: str) -> bool:
    """Whether a call with ``backend`` (already :func:`resolve`-d) on float32 CPU scores runs on the C kernels --
    named, or ``auto`` while they build and have not failed -- so that the operator may take its fused fast path
    there (``soft_topk._Fused``)."""
    if backend == "cpu" or (backend == "auto" and CPU not in _disabled):
        return CPU.usable() is None
    return False


def resolve(backend: str) -> str:
    """``backend``, or the :func:`use_backend` choice in force when it is ``"auto"``."""
    return getattr(_default, "name", "auto") if backend == "auto" else backend
