"""softmax_k_times, forward + backward, against its own version at another git revision, in one run:

    .venv/bin/python experiments/softmax_k_times_regression.py --against b0bca8a [--shapes 32x40000 64x50 320x1000]

Prints one row per (rows x n) shape: the median time of each version -- timed alternately, the other revision as
the baseline (``benchmarks/harness.py``) -- and their ratio (this / against), and the largest difference between
their outputs. Written for the per-rank shift (85b6ce0: one division per rank instead of one per call, for exact
saturation where x / T leaves the float range)."""
import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import harness  # noqa: E402

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


def forward_backward(fn, x, k):
    def run():
        fn(x.clone().requires_grad_(), k, epsilon=0.5).sum().backward()
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", required=True, help="git revision of the version to compare with")
    p.add_argument("--shapes", nargs="+", default=["32x40000", "64x50", "320x1000"], help="ROWSxN")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--repeats", type=int, default=9, help="rounds (median), after one warm-up round")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    harness.add_json_argument(p)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    other = at_revision(args.against)
    results = harness.Results("softmax_k_times_regression", args.json)
    print(harness.table_header(("rows x n", "k", "this (ms)", f"{args.against} (ms)", "ratio",
                                "max output difference")))
    torch.manual_seed(0)
    for shape in args.shapes:
        rows, n = map(int, shape.split("x"))
        x = torch.randn(rows, n) * 3
        timed = harness.compare((args.against, forward_backward(other, x, args.k)),
                                {"this": forward_backward(softmax_k_times, x, args.k)}, args.repeats)
        this, then = timed.seconds("this"), timed.seconds(args.against)
        diff = float((softmax_k_times(x, args.k, epsilon=0.5) - other(x, args.k, epsilon=0.5)).abs().max())
        results.add("this", this, shape=shape, baseline=args.against, baseline_seconds=then, k=args.k,
                    max_output_difference=diff)
        print(harness.table_row((shape, args.k, f"{this * 1e3:.2f}", f"{then * 1e3:.2f}", f"{this / then:.2f}",
                                 f"{diff:.1e}")), flush=True)


if __name__ == "__main__":
    main()
