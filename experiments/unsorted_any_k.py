"""The unsorted operator across k, at one shape: steps, accuracy and speed from k = 5 to k = n - 1.

    .venv/bin/python experiments/unsorted_any_k.py [--rows 64 --n 1000] [--ks 5 100 500 900 980 995 999]
        [--device cpu|cuda] [--backends FUSED torch] [--json PATH]

For each k and backend (by default the fused kernels of the device -- ``cpu``: the C kernels, ``cuda``: Triton --
and ``torch``, our PyTorch path), on standard normal scores with the paper scaling at epsilon 0.1, it prints the
mean Newton steps per row, the fraction of rows that report convergence (marginal error <= tol, 1e-6 in
float32), the largest error of the output against the same problem solved in float64 to 1e-13, and the largest
relative error of the unselected mass, |sum_i (1 - A_i) - (n - k)| / (n - k), summed in float64 from the output
(near k = n the mass that tells a soft top-k from all-ones). Then it times forward + backward of each backend
and, with the ``bench`` extra, of entmax's ``budget_bisect`` (50 bisection steps, a sparse top-k mask),
alternately with the first backend as the baseline (``benchmarks/harness.py``: rounds after one warm-up round,
medians; on a GPU the device finished before and after each call), and prints budget_bisect over the first
backend.
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import harness  # noqa: E402
from harness import forward_backward  # noqa: E402

from softtopk_fairseq.ops import soft_topk  # noqa: E402

try:  # the peer: entmax's budget_bisect (the `bench` extra), else its columns are left out
    from entmax import budget_bisect
except ImportError:  # pragma: no cover
    budget_bisect = None

EPS = 0.1
FUSED = {"cpu": "cpu", "cuda": "triton"}


def float64_solution(x, k):
    """The same problem solved in float64 to 1e-13: the reference of :func:`accuracy`."""
    with torch.no_grad():
        return soft_topk(x.double(), k, epsilon=EPS, scaling="paper", backend="torch", tol=1e-13, max_iter=200)


def accuracy(x, k, backend, ref):
    """(mean steps, fraction converged, max abs error against ``ref``, max relative unselected-mass error)."""
    with torch.no_grad():
        out, info = soft_topk(x, k, epsilon=EPS, scaling="paper", backend=backend, return_info=True)
    unselected = (1 - out.double()).sum(-1)
    n = x.shape[-1]
    return (float(info.iterations.float().mean()), float(info.converged.float().mean()),
            float((out.double() - ref).abs().max()), float(((unselected - (n - k)).abs() / (n - k)).max()))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--ks", type=int, nargs="+", default=[5, 100, 500, 900, 980, 995, 999])
    parser.add_argument("--peer-repeats", type=int, default=50, help="rounds of the timed ops (median)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=list(FUSED))
    parser.add_argument("--backends", nargs="+", choices=["cpu", "triton", "torch"],
                        help="default: the device's fused kernels, then torch")
    harness.add_json_argument(parser)
    args = parser.parse_args()
    backends = args.backends or [FUSED[args.device], "torch"]
    if args.threads:
        torch.set_num_threads(args.threads)
    bad = [k for k in args.ks if not 1 <= k < args.n]
    if bad:
        parser.error(f"--ks must be in [1, n) = [1, {args.n}), got {bad}")
    x = torch.randn(args.rows, args.n, generator=torch.Generator().manual_seed(0)).to(args.device)
    w = torch.randn(args.rows, args.n, 1, generator=torch.Generator().manual_seed(1)).to(args.device)
    head = ["k"] + [f"{b} {col}" for b in backends for col in ("steps", "converged", "err vs f64", "unselected err")]
    head += [f"{b} fwd+bwd" for b in backends]
    if budget_bisect is not None:
        head += ["budget_bisect", f"budget_bisect/{backends[0]}"]
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"{args.rows}x{args.n}, paper scaling, epsilon {EPS}, torch {torch.__version__}, {where}")
    print(harness.table_header(head))
    results = harness.Results("unsorted_any_k", args.json, device=args.device)
    for k in args.ks:
        cells = [str(k)]
        ref = float64_solution(x, k)
        for backend in backends:
            steps, converged, err, unselected = accuracy(x, k, backend, ref)
            cells += [f"{steps:.2f}", f"{converged:.0%}", f"{err:.1e}", f"{unselected:.1e}"]
        ops = {b: (lambda z, b=b: soft_topk(z, k, epsilon=EPS, scaling="paper", backend=b)) for b in backends}
        if budget_bisect is not None:
            ops["bisect"] = lambda z: budget_bisect(z, k)
        fns = {name: forward_backward(op, x, w) for name, op in ops.items()}
        first = backends[0]
        timed = harness.compare((first, fns.pop(first)), fns, args.peer_repeats, device=args.device)
        shape = f"{args.rows}x{args.n} k {k}"
        for name in timed.times:
            base = None if name == first else first
            results.add("budget_bisect" if name == "bisect" else name, timed.seconds(name), shape=shape,
                        baseline=base, baseline_seconds=timed.seconds(first) if base else None)
        cells += [f"{timed.seconds(b) * 1e3:.2f} ms" for b in backends]
        if budget_bisect is not None:
            cells += [f"{timed.seconds('bisect') * 1e3:.2f} ms", f"{timed.ratio('bisect'):.1f}x"]
        print(harness.table_row(cells), flush=True)


if __name__ == "__main__":
    main()
