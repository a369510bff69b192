"""softmax_k_times, forward + backward, against its own version at another git revision, in one run:

    .venv/bin/python benchmarks/bench_softmax_k_times.py --against b0bca8a [--shapes 32x40000 64x50 320x1000]

Prints one row per (rows x n) shape: the median time of each version and their ratio (this / against), and the
largest difference between their outputs. Written for the per-rank shift (85b6ce0: one division per rank instead
of one per call, for exact saturation where x / T leaves the float range) -- docs/results.md, "softmax-k-times:
the cost of the per-rank shift"."""
import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from softtopk_fairseq.ops import softmax_k_times  # noqa: E402

MODULE = "softtopk_fairseq/ops/softmax_k_times.py"


def at_revision(rev: str):
    """``softmax_k_times`` as the module was at git revision ``rev`` (its imports resolve to this checkout)."""
    source = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{MODULE}"], capture_output=True, text=True,
                            check=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"softmax_k_times_at_{rev}", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    os.unlink(f.name)
    return module.softmax_k_times


def seconds(fn, x, k, repeats):
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        xx = x.clone().requires_grad_()
        start = time.perf_counter()
        fn(xx, k, epsilon=0.5).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", required=True, help="git revision of the version to compare with")
    p.add_argument("--shapes", nargs="+", default=["32x40000", "64x50", "320x1000"], help="ROWSxN")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    other = at_revision(args.against)
    print(f"| rows x n | k | this (ms) | {args.against} (ms) | ratio | max output difference |")
    print("|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for shape in args.shapes:
        rows, n = map(int, shape.split("x"))
        x = torch.randn(rows, n) * 3
        this, then = seconds(softmax_k_times, x, args.k, args.repeats), seconds(other, x, args.k, args.repeats)
        diff = float((softmax_k_times(x, args.k, epsilon=0.5) - other(x, args.k, epsilon=0.5)).abs().max())
        print(f"| {shape} | {args.k} | {this * 1e3:.2f} | {then * 1e3:.2f} | {this / then:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
