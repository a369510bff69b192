"""What the fused kernels (``soft_topk_cpu.c`` through ``cpu_kernels``, ``triton_kernels``) and their launchers
agree on: the status bits the forwards report with (:data:`STATUS_BITS`, handed to the kernels from here), the
temperature arguments of a forward launch (:func:`temperature_outputs`), and contiguous tensor arguments -- the
launchers read raw pointers, so every tensor argument is made contiguous once, by one decorator
(:func:`ensure_contiguous`), instead of ``.contiguous()`` calls scattered through the callers."""
import functools

import torch

# What the fused kernels report (status bits), handed to them from here (constexprs, -D flags):
# - OUT_OF_MEMORY: a C kernel could not allocate its scratch memory (the launcher raises MemoryError);
# - CAPPED: a C forward's row stopped at max_iter above its tolerance (soft_topk warns; the row is solved);
# - BAD_NAN, BAD_INF, BAD_SCALE: a forward's row holds a NaN anywhere, +inf on a valid entry, or an infinite
#   temperature with scores whose range overflows float32 (the paper scaling's temperature, epsilon * max cost / 2,
#   is +inf once |scores| pass ~1.8e19 -- the cost squares them --, which normalises every score to 0, the right
#   limit, unless x - centre is infinite too: inf / inf). The row is left unsolved (the Triton kernels write it as
#   NaN) and the caller raises (backends.FusedBackend.raise_for_status), or with check_errors=False returns it as
#   NaN.
OUT_OF_MEMORY, BAD_NAN, BAD_INF, BAD_SCALE, CAPPED = 1, 2, 4, 8, 16
# The bits that say a row's scores were refused (the Triton kernels' per-row status: they allocate nothing, and
# their callers read the iteration counts).
REFUSAL_BITS = {"BAD_NAN": BAD_NAN, "BAD_INF": BAD_INF, "BAD_SCALE": BAD_SCALE}
REFUSED = BAD_NAN | BAD_INF | BAD_SCALE
STATUS_BITS = {"OUT_OF_MEMORY": OUT_OF_MEMORY, "CAPPED": CAPPED, **REFUSAL_BITS}


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
