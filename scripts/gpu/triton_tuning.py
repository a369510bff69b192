"""Launch parameters of the Triton kernels, and where the time of one soft_topk call goes, on a GPU.

    python scripts/gpu/triton_tuning.py [--shapes beam generic attention] [--repeats 20]

For each shape (the operator benchmark's shapes, ``benchmarks/harness.py``; sorted, k = 5, the paper's scaling) it captures the inputs the
``TritonBackend`` hands the kernels during a real call, then times the forward and backward kernels alone
(CUDA events, median) for each ``BLOCK_N`` x ``num_warps``, and the whole call (forward + backward through
autograd) for comparison -- the difference is the host-side work around the kernels. The default launch
parameters are the row marked ``*``.
"""
import argparse
import os
import statistics
import sys

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import harness  # noqa: E402
from harness import OPERATOR_K as K, OPERATOR_SHAPES as SHAPES, operator_scores  # noqa: E402

from softtopk_fairseq.ops import soft_topk  # noqa: E402
from softtopk_fairseq.ops import triton_kernels as tk  # noqa: E402


def cuda_time(fn, repeats):
    """Median milliseconds of ``repeats`` calls of ``fn`` on the GPU's clock, after one warm-up call."""
    harness.warm_up({"fn": fn})
    return statistics.median(harness.rounds({"fn": fn}, repeats, timer=harness.cuda_event_seconds)["fn"]) * 1e3


def captured_args(x, w):
    """The arguments of the forward and backward kernel launches of one soft_topk call."""
    seen = {}
    real_fwd, real_bwd = tk.forward, tk.backward

    def fwd(*args, **kw):
        seen["fwd"] = args
        return real_fwd(*args, **kw)

    def bwd(*args, **kw):
        seen["bwd"] = args
        return real_bwd(*args, **kw)

    tk.forward, tk.backward = fwd, bwd
    try:
        xg = x.clone().requires_grad_()
        (soft_topk(xg, K, sorted=True, scaling="paper", backend="triton") * w).sum().backward()
    finally:
        tk.forward, tk.backward = real_fwd, real_bwd
    return seen["fwd"], seen["bwd"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("triton_tuning: needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, sorted, k={K}, eps 0.1 paper scaling; kernel times in ms (median of "
          f"{args.repeats})")
    for name in args.shapes:
        rows, n = SHAPES[name]
        gen = torch.Generator().manual_seed(0)
        x = operator_scores(name, rows, n, gen)
        x, w = x.cuda(), torch.randn(rows, n, K, generator=gen).cuda()
        fwd_args, bwd_args = captured_args(x, w)
        mp = tk.padded_anchors(K + 1)
        default = tk.block_n(n, mp)

        def whole():
            xg = x.clone().requires_grad_()
            (soft_topk(xg, K, sorted=True, scaling="paper", backend="triton") * w).sum().backward()

        t_whole = cuda_time(whole, args.repeats)
        print(f"\n{name} {rows}x{n} (MP {mp}): whole call fwd+bwd {t_whole:.3f} ms")
        print("| BLOCK_N | warps | forward kernel | backward kernel |\n|---|---|---|---|")
        for block in (64, 256, 1024):
            if block > max(16, triton_next_pow2(n)) or block * mp * mp > 65536:
                continue
            for warps in (1, 4, 8):
                try:
                    t_f = cuda_time(lambda: tk.forward(*fwd_args, block=block, num_warps=warps), args.repeats)
                    t_b = cuda_time(lambda: tk.backward(*bwd_args, block=block, num_warps=warps), args.repeats)
                except Exception as e:  # out of resources at this size: say so and go on
                    print(f"| {block} | {warps} | failed: {type(e).__name__} | |")
                    continue
                mark = " *" if (block == default and warps == tk.warps_for(block, mp)) else ""
                print(f"| {block}{mark} | {warps} | {t_f:.3f} | {t_b:.3f} |", flush=True)


def triton_next_pow2(n):
    import triton
    return triton.next_power_of_2(n)


if __name__ == "__main__":
    main()
