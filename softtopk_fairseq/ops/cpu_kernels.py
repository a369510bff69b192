"""Fused CPU kernels for SOFT top-k (``soft_topk_cpu.c``): the CPU counterpart of ``triton_kernels.py``.

Eager PyTorch makes ~5 passes over the (rows, k+1, n) plan per Newton evaluation; these kernels make one
(per row, in blocks that stay in cache) and solve the whole row in one call, rows spread over
``torch.get_num_threads()`` OpenMP threads. Each operator is one call each way from the raw scores, with the
launchers' signatures of ``triton_kernels`` (:func:`forward`, :func:`unsorted_forward`, :func:`backward`,
:func:`unsorted_backward`): the checks, the centre, the temperature (the paper scaling's in the same pass, when
asked) and the start are found per row in C, which ``backends.Backend.solve`` prepares with tensor operations
for the PyTorch path; same math as ``solvers.newton_semi_dual`` / ``solvers.newton_sigmoid_root`` and
``implicit_backward.implicit_grad`` / ``implicit_backward.sigmoid_grad``. :func:`paper_temperature` computes the paper scaling's
temperature alone.

The C source is compiled on first use with the system C compiler (``$CC``, else ``cc``) for the host CPU
(``-march=native``; ``$SOFTTOPK_CPU_ARCH`` names another) and cached under ``$SOFTTOPK_CACHE_DIR`` (default
``~/.cache/softtopk_fairseq``), keyed
by the source, the flags, the compiler and the CPU's feature flags, so that a cache shared by different
machines never hands one a binary built for another. When no compiler works, :func:`library` raises and
``backend="auto"`` uses the PyTorch path with one warning (``backends.fall_back``).
"""
import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from typing import Optional

import torch

from softtopk_fairseq.ops.kernel_interface import OUT_OF_MEMORY, STATUS_BITS, ensure_contiguous, temperature_outputs
from softtopk_fairseq.ops.solvers import (BACKWARD_KERNEL_CONSTANTS, KERNEL_CONSTANTS, MAX_HALVINGS, SATURATION,
                                          UNSORTED_KERNEL_CONSTANTS)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "soft_topk_cpu.c")
# The forwards report a batch's bad rows and a failed allocation with kernel_interface.STATUS_BITS (bits of their
# return value), the backwards a failed allocation. The solver constants come from solvers.py as -D flags (part of
# the cache key with the other flags), the status bits from kernel_interface.py.
CONSTANTS = {**KERNEL_CONSTANTS, **BACKWARD_KERNEL_CONSTANTS, **UNSORTED_KERNEL_CONSTANTS, "SATURATION": SATURATION,
             **STATUS_BITS}
# -fno-trapping-math: no floating-point exception is ever unmasked here; it lets gcc turn the selects around
# divisions and comparisons into vector blends (the grouped unsorted solve's Newton step across 16 rows).
# $SOFTTOPK_CPU_ARCH (default native) is gcc's -march: another x86-64 level (x86-64, x86-64-v3, ...) computes here
# the bits another CPU's build would (tests/golden/spread.py), or builds one binary for a cluster's mixed nodes.
FLAGS = ["-O3", f"-march={os.environ.get('SOFTTOPK_CPU_ARCH', 'native')}", "-fopenmp", "-fno-math-errno",
         "-fno-trapping-math", "-fPIC", "-shared",
         *(f"-D{name}={value!r}" for name, value in sorted(CONSTANTS.items()))]

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_error: Optional[str] = None


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def cache_dir() -> str:
    return os.environ.get("SOFTTOPK_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "softtopk_fairseq"))


def _build() -> ctypes.CDLL:
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_features().encode(), platform.machine().encode()])).hexdigest()[:16]
    os.makedirs(cache_dir(), exist_ok=True)
    path = os.path.join(cache_dir(), f"soft_topk_cpu_{key}.so")
    if not os.path.exists(path):
        # Build under a temporary name and rename: processes started together (distributed workers)
        # never load a half-written library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir())
        os.close(fd)
        try:
            proc = subprocess.run([cc, *FLAGS, SOURCE, "-o", tmp, "-lm"], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed:\n{proc.stderr[:2000]}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(path)
    p, i64, i32, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    f32 = ctypes.c_float
    lib.soft_topk_sorted_forward.argtypes = [p, p, p, f32, p, p, i64, i64, i32, f64, i32, i32, f32, f32, p, p, i32]
    lib.soft_topk_sorted_forward.restype = ctypes.c_int
    lib.soft_topk_sorted_backward.argtypes = [p, p, p, p, p, p, p, i64, i64, i32, f32, i32]
    lib.soft_topk_sorted_backward.restype = ctypes.c_int
    lib.soft_topk_unsorted_forward.argtypes = [p, p, p, f32, p, p, i64, i64, i32, f64, i32, f32, f32, p, p, i32]
    lib.soft_topk_unsorted_forward.restype = ctypes.c_int
    lib.soft_topk_unsorted_backward.argtypes = [p, p, p, p, p, p, p, i64, i64, f32, p, p, i32]
    lib.soft_topk_unsorted_backward.restype = ctypes.c_int
    lib.soft_topk_paper_temperature.argtypes = [p, p, i64, i64, f32, f32, p, p, p, i32]
    lib.soft_topk_paper_temperature.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL:
    """The compiled kernels (built on first call); raises RuntimeError when they cannot be built."""
    global _lib, _error
    if _lib is not None:  # (every call asks: no lock once built)
        return _lib
    with _lock:
        if _lib is None and _error is None:
            try:
                _lib = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _error = f"{type(e).__name__}: {e}"
        if _lib is None:
            raise RuntimeError(f"soft_topk: the fused CPU kernels could not be built ({_error})")
        return _lib


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


@ensure_contiguous
def paper_temperature(x, mask, anchor_top, epsilon):
    """The paper scaling's per-row temperature of ``x`` (rows, n) over its valid entries (not ``-inf``; where
    ``mask`` (rows, n) bool is True, if given), in one pass: ``eps`` (rows,), the index ``at`` (rows,) int64
    where the row's maximal cost sits and the derivative ``slope`` (rows,) of eps in that entry
    (``soft_topk._PaperTemperature`` states the math)."""
    rows, n = x.shape
    eps, at, slope, _, _ = temperature_outputs(x, None, (anchor_top, epsilon))
    _check(x, mask)
    library().soft_topk_paper_temperature(_ptr(x), _ptr(mask), rows, n, float(anchor_top), float(epsilon), _ptr(eps),
                                          _ptr(at), _ptr(slope), torch.get_num_threads())
    return eps, at, slope


@ensure_contiguous
def forward(x, mask, eps, k, bound, tol, max_iter, paper=None, max_halvings=MAX_HALVINGS):
    """The sorted forward on raw scores ``x`` (rows, n) float32 (``-inf`` excluded), the caller's ``mask`` (rows, n)
    bool or None, and either the per-row temperature ``eps`` (rows,) or ``paper = (anchor_top, epsilon)``, the
    paper scaling's parameters (``eps`` None: computed). Returns (out (rows, n, k), info (rows, 2), status --
    0 or the bits of ``kernel_interface.STATUS_BITS`` (a NaN anywhere, +inf on a valid entry, an infinite temperature over
    a range of scores that overflows), for the caller to raise on --, eps, at, slope); ``at`` and ``slope`` are
    None without ``paper``."""
    rows, n = x.shape
    return _forward(library().soft_topk_sorted_forward, (rows, n, k), x, mask, eps, k, bound, tol, max_iter, paper,
                    (int(max_halvings),))


@ensure_contiguous
def unsorted_forward(x, mask, eps, k, bound, tol, max_iter, paper=None):
    """The unsorted forward: the arguments and results of :func:`forward`, the output (rows, n)."""
    return _forward(library().soft_topk_unsorted_forward, x.shape, x, mask, eps, k, bound, tol, max_iter, paper, ())


def _forward(entry, out_shape, x, mask, eps, k, bound, tol, max_iter, paper, extra):
    rows, n = x.shape
    out = torch.empty(out_shape, dtype=torch.float32)
    info = torch.empty((rows, 2), dtype=torch.float32)
    eps, at, slope, anchor_top, epsilon = temperature_outputs(x, eps, paper)
    _check(x, mask, eps)
    status = entry(_ptr(x), _ptr(mask), _ptr(eps), float(bound), _ptr(out), _ptr(info), rows, n, k, float(tol),
                   int(max_iter), *extra, float(anchor_top), float(epsilon), _ptr(at), _ptr(slope),
                   torch.get_num_threads())
    _raise_if_out_of_memory(status)
    return out, info, status, eps, at, slope


@ensure_contiguous
def backward(out, grad_out, x, mask, eps, k, eps_grad):
    """The sorted backward: dL/dx (rows, n) from the output ``out`` (rows, n, k), ``grad_out`` like it, the raw
    scores ``x`` and ``mask`` of the forward and its temperature ``eps`` (``implicit_backward.implicit_grad``, divided by
    eps); and dL/deps (rows,) when ``eps_grad`` (``implicit_backward.temperature_grad``), else None."""
    rows, n = x.shape
    grad = torch.empty((rows, n), dtype=torch.float32)
    grad_eps = torch.empty((rows,), dtype=torch.float32) if eps_grad else None
    _check(out, grad_out, x, mask, eps)
    _raise_if_out_of_memory(library().soft_topk_sorted_backward(
        _ptr(out), _ptr(grad_out), _ptr(mask), _ptr(x), _ptr(eps), _ptr(grad), _ptr(grad_eps), rows, n, k, 0.0,
        torch.get_num_threads()))
    return grad, grad_eps


@ensure_contiguous
def unsorted_backward(out, grad_out, x, mask, eps, k, eps_grad):
    """The unsorted backward: the arguments and results of :func:`backward` (``implicit_backward.sigmoid_grad``; ``k``
    unused, the gradient does not depend on it)."""
    rows, n = out.shape
    grad = torch.empty((rows, n), dtype=torch.float32)
    grad_eps = torch.empty((rows,), dtype=torch.float32) if eps_grad else None
    _check(out, grad_out, mask, eps, x)
    _raise_if_out_of_memory(library().soft_topk_unsorted_backward(
        _ptr(out), _ptr(grad_out), _ptr(mask), _ptr(eps), _ptr(x) if eps_grad else None, _ptr(grad), _ptr(grad_eps),
        rows, n, 0.0, None, None, torch.get_num_threads()))
    return grad, grad_eps


_scratch = threading.local()


def _info_scratch(rows: int) -> torch.Tensor:
    """This thread's (rows, 2) float32 buffer for a fused forward's info, grown as needed and reused: the info is
    read only when a row is capped (or for ``return_info``, which copies it), so the common call allocates
    nothing for it."""
    buf = getattr(_scratch, "info", None)
    if buf is None or buf.shape[0] < rows:
        buf = _scratch.info = torch.empty((max(rows, 64), 2), dtype=torch.float32)
    return buf


def unsorted_fused_forward(x, k, epsilon, paper, bound, tol, max_iter):
    """The unsorted forward for the operator's fast path on float32 CPU scores ``x`` (any shape, selected along
    the last dimension), contiguous, all entries valid but ``-inf`` ones, no mask: its output (x's shape), the
    status bits (kernel_interface.STATUS_BITS: refused rows, CAPPED), the info (rows, 2) -- a view of this
    thread's scratch, overwritten by its next call: read it at once or copy it -- and with ``paper`` the paper
    scaling's eps, at and slope (rows,) computed in the same pass (``paper = (anchor_top, epsilon)``); without
    it every row's temperature is ``epsilon`` (no per-row tensor). Nothing else allocated: the caller checked
    the arguments."""
    n = x.shape[-1]
    rows = x.numel() // n
    out = torch.empty_like(x)
    info = _info_scratch(rows)
    if paper is None:
        eps = at = slope = None
        anchor_top, temperature = 0.0, epsilon
    else:
        eps, at, slope, anchor_top, temperature = temperature_outputs(x.view(rows, n), None, paper)
    status = library().soft_topk_unsorted_forward(
        x.data_ptr(), None, _ptr(eps), bound, out.data_ptr(), info.data_ptr(), rows, n, k, tol, max_iter, anchor_top,
        temperature, _ptr(at), _ptr(slope), torch.get_num_threads())
    _raise_if_out_of_memory(status)
    return out, status, info[:rows], eps, at, slope


def unsorted_fused_backward(out, grad_out, x, eps, epsilon, at, slope):
    """dL/dx (out's shape) for :func:`unsorted_fused_forward`'s output: with ``at`` and ``slope`` (the paper
    scaling) dL/deps * d eps / d x is added in the same pass, from ``x`` and the per-row ``eps``; else every
    row's temperature is ``epsilon``. Tensors contiguous, float32, on CPU."""
    n = out.shape[-1]
    grad = torch.empty_like(out)
    _raise_if_out_of_memory(library().soft_topk_unsorted_backward(
        out.data_ptr(), grad_out.data_ptr(), None, _ptr(eps), _ptr(x), grad.data_ptr(), None, out.numel() // n, n,
        epsilon, _ptr(at), _ptr(slope), torch.get_num_threads()))
    return grad


def sorted_fused_forward(x, k, epsilon, bound, tol, max_iter):
    """The sorted forward for the operator's fast path: :func:`unsorted_fused_forward`'s arguments and results
    (the output ``x.shape + (k,)``) at the temperature ``epsilon`` for every row (no paper scaling)."""
    n = x.shape[-1]
    rows = x.numel() // n
    out = torch.empty((*x.shape, k), dtype=torch.float32)
    info = _info_scratch(rows)
    status = library().soft_topk_sorted_forward(
        x.data_ptr(), None, None, bound, out.data_ptr(), info.data_ptr(), rows, n, k, tol, max_iter, MAX_HALVINGS,
        0.0, epsilon, None, None, torch.get_num_threads())
    _raise_if_out_of_memory(status)
    return out, status, info[:rows], None, None, None


def sorted_fused_backward(out, grad_out, x, epsilon):
    """dL/dx (x's shape) for :func:`sorted_fused_forward`'s output ``out`` at the temperature ``epsilon``; tensors
    contiguous, float32, on CPU."""
    n, k = x.shape[-1], out.shape[-1]
    grad = torch.empty_like(x)
    _raise_if_out_of_memory(library().soft_topk_sorted_backward(
        out.data_ptr(), grad_out.data_ptr(), None, x.data_ptr(), None, grad.data_ptr(), None, x.numel() // n, n, k,
        epsilon, torch.get_num_threads()))
    return grad


def _raise_if_out_of_memory(status: int) -> None:
    if status & OUT_OF_MEMORY:
        raise MemoryError("soft_topk: the CPU kernel could not allocate its scratch memory")


def _check(*tensors) -> None:
    """The C code reads raw pointers: contiguous CPU tensors of the dtypes it expects, or None."""
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"cpu_kernels: needs contiguous CPU tensors, got one on {t.device}")
        if t.dtype not in (torch.float32, torch.int32, torch.bool):
            raise ValueError(f"cpu_kernels: computes in float32, got a {t.dtype} tensor (use backend='torch')")
