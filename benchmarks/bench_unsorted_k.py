"""The unsorted operator across k, at one shape: steps, accuracy and speed from k = 5 to k = n - 1.

    .venv/bin/python benchmarks/bench_unsorted_k.py [--rows 64 --n 1000] [--ks 5 100 500 900 980 995 999]

For each k and backend (``cpu``: the fused C kernels; ``torch``: our PyTorch path), on standard normal scores
with the paper scaling at epsilon 0.1, it prints the mean Newton steps per row, the fraction of rows that
report convergence (marginal error <= tol, 1e-6 in float32), the largest error of the output against the
same problem solved in float64 to 1e-13, and the largest relative error of the unselected mass,
|sum_i (1 - A_i) - (n - k)| / (n - k), summed in float64 from the output (near k = n the mass that tells a
soft top-k from all-ones). With the ``bench`` extra it also times forward + backward of the C path and of
entmax's ``budget_bisect`` (50 bisection steps, a sparse top-k mask) in turn (bench_soft_topk's
``interleaved_medians``) and prints their ratio.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_soft_topk import budget_bisect, fwd_bwd, interleaved_medians  # noqa: E402

from softtopk_fairseq.ops import soft_topk  # noqa: E402

EPS = 0.1
BACKENDS = ("cpu", "torch")


def accuracy(x, k, backend):
    """(mean steps, fraction converged, max abs error against float64, max relative unselected-mass error)."""
    with torch.no_grad():
        out, info = soft_topk(x, k, epsilon=EPS, scaling="paper", backend=backend, return_info=True)
        ref = soft_topk(x.double(), k, epsilon=EPS, scaling="paper", backend="torch", tol=1e-13, max_iter=200)
    unselected = (1 - out.double()).sum(-1)
    n = x.shape[-1]
    return (float(info.iterations.float().mean()), float(info.converged.float().mean()),
            float((out.double() - ref).abs().max()), float(((unselected - (n - k)).abs() / (n - k)).max()))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--ks", type=int, nargs="+", default=[5, 100, 500, 900, 980, 995, 999])
    parser.add_argument("--peer-repeats", type=int, default=50, help="calls of each timed op, interleaved")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bad = [k for k in args.ks if not 1 <= k < args.n]
    if bad:
        parser.error(f"--ks must be in [1, n) = [1, {args.n}), got {bad}")
    x = torch.randn(args.rows, args.n, generator=torch.Generator().manual_seed(0))
    w = torch.randn(args.rows, args.n, 1, generator=torch.Generator().manual_seed(1))
    head = ["k"] + [f"{b} {col}" for b in BACKENDS for col in ("steps", "converged", "err vs f64", "unselected err")]
    if budget_bisect is not None:
        head += ["cpu fwd+bwd", "budget_bisect", "budget_bisect/cpu"]
    print(f"{args.rows}x{args.n}, paper scaling, epsilon {EPS}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for k in args.ks:
        cells = [str(k)]
        for backend in BACKENDS:
            steps, converged, err, unselected = accuracy(x, k, backend)
            cells += [f"{steps:.2f}", f"{converged:.0%}", f"{err:.1e}", f"{unselected:.1e}"]
        if budget_bisect is not None:
            t = interleaved_medians({"ours": fwd_bwd(lambda z: soft_topk(z, k, epsilon=EPS, scaling="paper",
                                                                         backend="cpu"), x, w),
                                     "bisect": fwd_bwd(lambda z: budget_bisect(z, k), x, w)}, args.peer_repeats)
            cells += [f"{t['ours'] * 1e3:.2f} ms", f"{t['bisect'] * 1e3:.2f} ms", f"{t['bisect'] / t['ours']:.1f}x"]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
