"""Launch hygiene shared by the fused kernels (``cpu_kernels``, ``triton_kernels``): their launchers read raw
pointers, so every tensor argument must be contiguous -- done once here, by one decorator, instead of
``.contiguous()`` calls scattered through the callers."""
import functools

import torch


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
