"""Launch hygiene shared by the fused kernels (``cpu_kernels``, ``triton_kernels``): their launchers read raw
pointers, so every tensor argument must be contiguous -- done once here, by one decorator, instead of
``.contiguous()`` calls scattered through the callers; and the status bits their forwards report bad scores
with."""
import functools

import torch

# What the fused forward kernels report about a row's scores (status bits; the C kernels use 1 for "out of
# memory"): a NaN anywhere in the row, or +inf on a valid entry. The caller raises (backends.raise_for_status).
BAD_NAN, BAD_INF = 2, 4


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
