"""Launch hygiene shared by the fused kernels (``cpu_kernels``, ``triton_kernels``): their launchers read raw
pointers, so every tensor argument must be contiguous -- done once here, by one decorator, instead of
``.contiguous()`` calls scattered through the callers; and the status bits their forwards report bad scores
with."""
import functools

import torch

# What the fused forward kernels report about a row (status bits; the C kernels use 1 for "out of memory"): a
# NaN anywhere in the row, +inf on a valid entry, or an infinite temperature with scores whose range overflows
# float32 (the paper scaling's temperature, epsilon * max cost / 2, is +inf once |scores| pass ~1.8e19 -- the
# cost squares them --, which normalises every score to 0, the right limit, unless x - centre is infinite too:
# inf / inf). The row is left unsolved (the Triton kernels write it as NaN) and the caller raises
# (backends.FusedBackend.raise_for_status), or with check_errors=False returns it as NaN. Handed
# to the kernels (constexprs, -D flags) from here.
BAD_NAN, BAD_INF, BAD_SCALE = 2, 4, 8
STATUS_BITS = {"BAD_NAN": BAD_NAN, "BAD_INF": BAD_INF, "BAD_SCALE": BAD_SCALE}


def temperature_outputs(x: torch.Tensor, eps, paper):
    """The temperature arguments of a forward launch on (rows, n) scores ``x``: with ``paper = (anchor_top,
    epsilon)`` the empty eps (float32), at (int64) and slope (float32) tensors, each (rows,) on x's device, that
    the kernel fills with the paper scaling's temperature; else the given ``eps`` and None, None. Then anchor_top
    and epsilon (0.0 without ``paper``)."""
    if paper is None:
        return eps, None, None, 0.0, 0.0
    rows = x.shape[0]
    eps_and_slope = torch.empty((2, rows), dtype=torch.float32, device=x.device)  # one allocation, two rows
    return eps_and_slope[0], torch.empty((rows,), dtype=torch.int64, device=x.device), eps_and_slope[1], *paper


def ensure_contiguous(fn):
    """Make every tensor argument of ``fn`` contiguous (a no-op for those already are)."""

    def fix(v):
        return v.contiguous() if isinstance(v, torch.Tensor) else v

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        # (a list, and kwargs only when given: this runs on every kernel call, and small calls are dominated
        # by such host work)
        if kwargs:
            kwargs = {k: fix(v) for k, v in kwargs.items()}
        return fn(*[fix(a) for a in args], **kwargs)

    return wrapper
