"""Speed, memory and accuracy of soft_topk against the paper's code and its peers, measured side by side in one run.

    .venv/bin/python benchmarks/bench_soft_topk.py [--shapes generic attention beam] [--repeats 5] [--json PATH]
    .venv/bin/python benchmarks/bench_soft_topk.py --device cuda [--repeats 10]

For each shape (rows x n, k = 5, float32, forward + backward of a random linear loss) it prints the median time
of: our sorted and unsorted op (Newton + closed-form backward; ``backend="auto"``, which on CPU runs the fused C
kernels of ``cpu_kernels.py``), our sorted op on the eager PyTorch path (``backend="torch"``), a faithful
re-implementation of the authors' code (fixed 200 Sinkhorn iterations + their backward, ``paper_reference.py``),
autograd through the same 200 unrolled log-domain Sinkhorn iterations, and hard ``torch.topk`` (forward only);
the peers of the unsorted op: our PyTorch path, entmax's ``budget_bisect`` (50 bisection steps, a sparse top-k
mask, from the ``bench`` extra) and the perturbed top-k of Berthet et al. with 10 and 100 samples and its
Monte-Carlo backward; the speed-up of our sorted op over the paper's code; peak memory allocated during the
backward; and the max abs error of the sorted output against a float64 solution converged to 1e-13 of the
problem each one solves (the paper's scaling, epsilon 0.1: per row for ours, batch-wide for the authors' code).

Timing (``harness.py``): each group of ops is timed alternately with its baseline in rounds, after one warm-up
round -- the sorted ops with ours sorted (``--repeats`` rounds; the unrolled iterations in rounds of their own,
half as many), the unsorted peers with ours unsorted (``--peer-repeats`` rounds: fast ops), the perturbed top-k
with ours unsorted (half of ``--repeats``) -- so that a ratio is not moved by the machine's speed drifting.

With ``--device cuda`` it prints the GPU table instead: the fused Triton kernels against our PyTorch path, the
paper's code and ``torch.topk`` at every shape, all timed alternately on the GPU's clock (CUDA events).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import OPERATOR_K as K, OPERATOR_SHAPES as SHAPES, forward_backward, operator_scores  # noqa: E402

from softtopk_fairseq.ops import perturbed_topk, soft_topk  # noqa: E402
from softtopk_fairseq.ops.paper_reference import paper_sorted_soft_topk  # noqa: E402

try:  # a peer for the unsorted operator: entmax's budget_bisect (the `bench` extra), else its column is "-"
    from entmax import budget_bisect
except ImportError:  # pragma: no cover
    budget_bisect = None

EPS = 0.1
CPU_COLUMNS = ("shape", "ours sorted", "ours unsorted", "ours sorted torch path", "paper 200it", "unrolled 200it",
               "torch.topk", "paper/ours", "bwd peak ours", "bwd peak paper", "err ours", "err paper",
               "ours unsorted torch path", "entmax budget_bisect", "budget_bisect/ours unsorted",
               "perturbed 10 unsorted", "perturbed 100 unsorted")
GPU_COLUMNS = ("shape", "triton sorted", "triton unsorted", "torch path sorted", "torch path unsorted",
               "paper 200it", "torch.topk", "torch/triton sorted", "torch/triton unsorted", "paper/triton")


def ours(sorted, backend="auto"):
    return lambda z: soft_topk(z, K, epsilon=EPS, sorted=sorted, scaling="paper", backend=backend)


def paper(z):
    return paper_sorted_soft_topk(z, K, epsilon=EPS, max_iter=200)


def peak_backward_bytes(forward):
    """Peak CPU memory allocated by torch during the backward (torch.profiler memory events)."""
    out, loss_weights, x = forward()
    loss = (out * loss_weights).sum()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    events = sorted((e for e in prof.events() if e.cpu_memory_usage != 0), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.cpu_memory_usage
        peak = max(peak, live)
    return peak


def unrolled_sinkhorn(x, iters=200):
    """Autograd through 200 log-domain Sinkhorn iterations on the paper's problem."""
    rows, n = x.shape
    anchors = torch.arange(K, -1, -1, dtype=x.dtype)
    cost = (x.unsqueeze(-1) - anchors) ** 2
    cost = cost / cost.amax(dim=(1, 2), keepdim=True).detach()
    log_mu = torch.full((rows, n, 1), -torch.log(torch.tensor(float(n))).item())
    nu = torch.tensor([1.0] * K + [n - K]) / n
    log_nu = torch.log(nu).view(1, 1, -1)
    f = torch.zeros(rows, n, 1)
    g = torch.zeros(rows, 1, K + 1)
    for _ in range(iters):
        f = EPS * log_mu - EPS * torch.logsumexp((g - cost) / EPS, dim=-1, keepdim=True)
        g = EPS * log_nu - EPS * torch.logsumexp((f - cost) / EPS, dim=-2, keepdim=True)
    return torch.exp((f + g - cost) / EPS)[..., :K] * n


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the sorted ops (median)")
    parser.add_argument("--peer-repeats", type=int, default=50,
                        help="rounds of the unsorted peers (ours, our PyTorch path, budget_bisect)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--no-unrolled", action="store_true", help="skip autograd through unrolled Sinkhorn")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: only the GPU table (Triton kernels against our PyTorch path and the paper's)")
    harness.add_json_argument(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = harness.Results("bench_soft_topk", args.json, device=args.device)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench_soft_topk: --device cuda but torch sees no CUDA device")
        bench_gpu(args, results)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, k={K}, eps={EPS} "
          f"(paper scaling), forward+backward; each group timed alternately with its baseline: median of "
          f"{args.repeats} rounds (unsorted peers: {args.peer_repeats})")
    print(harness.table_header(CPU_COLUMNS))
    for name in args.shapes:
        bench_shape(name, args, results)


def bench_gpu(args, results):
    """On a GPU, every shape: the fused Triton kernels (sorted and unsorted) against our PyTorch path, the
    paper's code and hard ``torch.topk``, all timed alternately on the GPU's clock (CUDA events around each
    forward + backward, median of ``--repeats`` rounds after one warm-up, which compiles the kernels); the ratios
    are our PyTorch path over Triton and the paper's code over Triton."""
    print(f"\nGPU {torch.cuda.get_device_name()}, torch {torch.__version__}, float32, k={K}, eps={EPS} (paper "
          f"scaling), forward+backward, alternately, median of {args.repeats} rounds (CUDA events)")
    print(harness.table_header(GPU_COLUMNS))
    for name in args.shapes:
        rows, n = SHAPES[name]
        gen = torch.Generator().manual_seed(0)
        x = operator_scores(name, rows, n, gen).cuda()
        w = torch.randn(rows, n, K, generator=gen).cuda()
        timed = harness.compare(("triton sorted", forward_backward(ours(True, "triton"), x, w)), {
            "triton unsorted": forward_backward(ours(False, "triton"), x, w),
            "torch path sorted": forward_backward(ours(True, "torch"), x, w),
            "torch path unsorted": forward_backward(ours(False, "torch"), x, w),
            "paper 200it": forward_backward(paper, x, w),
            "torch.topk": lambda: torch.topk(x, K, dim=-1),
        }, args.repeats, timer=harness.cuda_event_seconds)
        t = {row: timed.seconds(row) for row in timed.times}
        shape = f"{name} {rows}x{n}"
        for row, baseline in (("triton sorted", None), ("triton unsorted", None),
                              ("torch path sorted", "triton sorted"), ("torch path unsorted", "triton unsorted"),
                              ("paper 200it", "triton sorted"), ("torch.topk", "triton sorted")):
            results.add(row, t[row], shape=shape, baseline=baseline, baseline_seconds=t.get(baseline),
                        **({"pass": "forward"} if row == "torch.topk" else {}))
        cells = [shape, *(f"{t[row] * 1e3:.2f} ms" for row in GPU_COLUMNS[1:5]), f"{t['paper 200it'] * 1e3:.2f} ms",
                 f"{t['torch.topk'] * 1e3:.3f} ms", f"{t['torch path sorted'] / t['triton sorted']:.1f}x",
                 f"{t['torch path unsorted'] / t['triton unsorted']:.1f}x",
                 f"{t['paper 200it'] / t['triton sorted']:.1f}x"]
        print(harness.table_row(cells), flush=True)


def bench_shape(name, args, results):
    rows, n = SHAPES[name]
    shape = f"{name} {rows}x{n}"
    gen = torch.Generator().manual_seed(0)
    x = operator_scores(name, rows, n, gen)
    w = torch.randn(rows, n, K, generator=gen)
    sorted_op, unsorted_op = forward_backward(ours(True), x, w), forward_backward(ours(False), x, w)
    # The sorted ops, alternately with ours sorted; the unrolled iterations (slow) in rounds of their own.
    sorted_ops = harness.compare(("ours sorted", sorted_op), {
        "ours sorted torch path": forward_backward(ours(True, "torch"), x, w),
        "paper 200it": forward_backward(paper, x, w),
        "torch.topk": lambda: torch.topk(x, K, dim=-1),
    }, args.repeats)
    unrolled = None
    if not args.no_unrolled and rows * n <= 300_000:
        unrolled = harness.compare(("ours sorted", sorted_op),
                                   {"unrolled 200it": forward_backward(unrolled_sinkhorn, x, w)},
                                   max(1, args.repeats // 2))
    # The unsorted op's peers, alternately with it: our PyTorch path and entmax's 50-iteration bisection -- fast
    # ops, so many rounds --; then the perturbed top-k (10 and 100 samples, Monte-Carlo backward).
    peers = {"ours unsorted torch path": forward_backward(ours(False, "torch"), x, w)}
    if budget_bisect is not None:
        peers["entmax budget_bisect"] = forward_backward(lambda z: budget_bisect(z, K), x, w)
    unsorted_peers = harness.compare(("ours unsorted", unsorted_op), peers, args.peer_repeats)
    perturbed = harness.compare(("ours unsorted", unsorted_op), {
        f"perturbed {samples} unsorted": forward_backward(
            lambda z, samples=samples: perturbed_topk(z, K, sigma=EPS, samples=samples), x, w)
        for samples in (10, 100)}, max(1, args.repeats // 2))

    def fwd_of(op):
        def run():
            xg = x.clone().requires_grad_()
            return op(xg), w, xg
        return run

    mem = {"ours": peak_backward_bytes(fwd_of(ours(True))), "paper": peak_backward_bytes(fwd_of(paper))}
    with torch.no_grad():
        ref = soft_topk(x.double(), K, epsilon=EPS, sorted=True, scaling="paper", tol=1e-13, max_iter=200)
        err_ours = (ours(True)(x).double() - ref).abs().max().item()
        # The authors' code solves another problem (cost scaled by the batch-wide maximum): compare it
        # with that problem solved to convergence, i.e. one temperature eps * M_batch / 2 for all rows.
        x64 = x.double()
        m_batch = torch.maximum(x64.square(), (x64 - K).square()).max().item()
        ref_paper = soft_topk(x64, K, epsilon=EPS * m_batch / 2, sorted=True, tol=1e-13, max_iter=200)
        err_paper = (paper(x).double() - ref_paper).abs().max().item()

    def add(timed, row, **figures):
        base = timed.baseline if row != timed.baseline else None
        return results.add(row, timed.seconds(row), shape=shape, baseline=base,
                           baseline_seconds=timed.seconds(base) if base else None, **figures)

    add(sorted_ops, "ours sorted", bwd_peak_mib=mem["ours"] / 2**20, max_abs_error=err_ours)
    add(sorted_ops, "ours sorted torch path")
    add(sorted_ops, "paper 200it", bwd_peak_mib=mem["paper"] / 2**20, max_abs_error=err_paper)
    add(sorted_ops, "torch.topk", **{"pass": "forward"})
    if unrolled is not None:
        add(unrolled, "unrolled 200it")
    add(unsorted_peers, "ours unsorted")
    for row in unsorted_peers.rows + perturbed.rows:
        add(unsorted_peers if row in unsorted_peers.times else perturbed, row)

    t_sorted, t_paper = sorted_ops.seconds("ours sorted"), sorted_ops.seconds("paper 200it")
    t_unrolled = unrolled.seconds("unrolled 200it") if unrolled is not None else float("nan")
    t_unsorted = unsorted_peers.seconds("ours unsorted")
    bisect = f"{unsorted_peers.seconds('entmax budget_bisect') * 1e3:.1f} ms" if budget_bisect else "-"
    bisect_ratio = f"{unsorted_peers.ratio('entmax budget_bisect'):.1f}x" if budget_bisect else "-"
    cells = [shape, f"{t_sorted * 1e3:.1f} ms", f"{t_unsorted * 1e3:.1f} ms",
             f"{sorted_ops.seconds('ours sorted torch path') * 1e3:.1f} ms", f"{t_paper * 1e3:.1f} ms",
             f"{t_unrolled * 1e3:.1f} ms", f"{sorted_ops.seconds('torch.topk') * 1e3:.2f} ms",
             f"{t_paper / t_sorted:.1f}x", f"{mem['ours'] / 2**20:.1f} MiB", f"{mem['paper'] / 2**20:.1f} MiB",
             f"{err_ours:.1e}", f"{err_paper:.1e}", f"{unsorted_peers.seconds('ours unsorted torch path') * 1e3:.1f} ms",
             bisect, bisect_ratio, f"{perturbed.seconds('perturbed 10 unsorted') * 1e3:.1f} ms",
             f"{perturbed.seconds('perturbed 100 unsorted') * 1e3:.1f} ms"]
    print(harness.table_row(cells), flush=True)


if __name__ == "__main__":
    main()
