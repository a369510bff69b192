"""Speed, memory and accuracy of soft_topk against the paper's code, measured side by side in one run.

    .venv/bin/python benchmarks/bench_soft_topk.py [--shapes generic attention beam] [--repeats 5]

For each shape (rows x n, k = 5, float32, forward + backward of a random linear loss) it prints the
median time of the unsorted operator's peers too (our PyTorch path and entmax's ``budget_bisect`` -- 50
bisection steps, a sparse top-k mask, from the ``bench`` extra -- timed in turn with ours, ``--peer-repeats``
calls each, so that the ratio budget_bisect / ours unsorted is not moved by the machine's speed drifting; and
the perturbed top-k of Berthet et al. with 10 and 100 samples and its Monte-Carlo backward), and the
median time of: our sorted and unsorted op (Newton + closed-form backward; ``backend="auto"``, which on CPU
runs the sorted op in the fused C kernels of ``cpu_kernels.py``), our sorted op on the eager PyTorch path
(``backend="torch"``), a faithful re-implementation of
the authors' code (fixed 200 Sinkhorn iterations + their backward, ``paper_reference.py``), autograd through
the same 200 unrolled log-domain Sinkhorn iterations, and hard ``torch.topk``; the speed-up of our sorted op
over the paper's code; peak memory allocated during the backward; and the max abs error of the sorted output
against a float64 solution converged to 1e-13 of the problem each one solves (the paper's scaling, epsilon
0.1: per row for ours, batch-wide for the authors' code). With ``--device cuda`` it prints the GPU table
instead: the fused Triton kernels against our PyTorch path and the paper's code at every shape.
"""
import argparse
import statistics
import time

import torch

from softtopk_fairseq.ops import perturbed_topk, soft_topk
from softtopk_fairseq.ops.paper_reference import paper_sorted_soft_topk

try:  # a peer for the unsorted operator: entmax's budget_bisect (the `bench` extra), else its column is "-"
    from entmax import budget_bisect
except ImportError:  # pragma: no cover
    budget_bisect = None

SHAPES = {"generic": (64, 1000), "attention": (7680, 32), "beam": (8, 50000)}
K = 5
EPS = 0.1


def make_scores(name, rows, n, gen):
    x = torch.randn(rows, n, generator=gen)
    if name == "beam":  # cumulative log-probabilities of candidates
        x = torch.log_softmax(3 * x, dim=-1)
    return x


def median_time(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(fns, repeats):
    """Median seconds of each of ``fns`` (name -> callable), called in turn ``repeats`` times after a warm-up
    round: a drift in the machine's speed during the run hits all of them alike, so their ratios compare."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


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


def fwd_bwd(op, x, weights):
    def run():
        xg = x.clone().requires_grad_()
        out = op(xg)
        (out * weights[..., : out.shape[-1]] if out.dim() == 3 else out * weights[..., 0]).sum().backward()
    return run


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
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peer-repeats", type=int, default=50,
                        help="calls of each unsorted peer (ours, our PyTorch path, budget_bisect), interleaved")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--no-unrolled", action="store_true", help="skip autograd through unrolled Sinkhorn")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: only the GPU table (Triton kernels against our PyTorch path and the paper's)")
    args = parser.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench_soft_topk: --device cuda but torch sees no CUDA device")
        bench_gpu(args)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, k={K}, eps={EPS} "
          f"(paper scaling), forward+backward, median of {args.repeats} (unsorted peers: {args.peer_repeats}, "
          "interleaved)")
    header = ("shape", "ours sorted", "ours unsorted", "ours sorted torch path", "paper 200it", "unrolled 200it", "torch.topk",
              "paper/ours", "bwd peak ours", "bwd peak paper", "err ours", "err paper", "ours unsorted torch path",
              "entmax budget_bisect", "budget_bisect/ours unsorted", "perturbed 10 unsorted",
              "perturbed 100 unsorted")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name in args.shapes:
        bench_shape(name, args)


def bench_gpu(args):
    """On a GPU, every shape: the fused Triton kernels (sorted and unsorted) against our PyTorch path, the
    paper's code and hard ``torch.topk``; the ratio is our PyTorch path over Triton (target >= 5x at the
    beam shape). Timed with CUDA events around each forward + backward, median of ``--repeats``."""
    print(f"\nGPU {torch.cuda.get_device_name()}, torch {torch.__version__}, float32, k={K}, eps={EPS} (paper "
          f"scaling), forward+backward, median of {args.repeats}")
    header = ("shape", "triton sorted", "triton unsorted", "torch path sorted", "torch path unsorted",
              "paper 200it", "torch.topk", "torch/triton sorted", "torch/triton unsorted", "paper/triton")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name in args.shapes:
        rows, n = SHAPES[name]
        gen = torch.Generator().manual_seed(0)
        x = make_scores(name, rows, n, gen).cuda()
        w = torch.randn(rows, n, K, generator=gen).cuda()

        def timed(op, x=x, w=w):
            run = fwd_bwd(op, x, w)
            run()  # warm-up (compiles the kernels)
            times = []
            for _ in range(args.repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return statistics.median(times)

        def ours(sorted, backend):
            return lambda z: soft_topk(z, K, epsilon=EPS, sorted=sorted, scaling="paper", backend=backend)

        t = {key: timed(ours(srt, be)) for key, srt, be in (("ts", True, "triton"), ("tu", False, "triton"),
                                                             ("ps", True, "torch"), ("pu", False, "torch"))}
        t_paper = timed(lambda z: paper_sorted_soft_topk(z, K, epsilon=EPS, max_iter=200))
        start = time.perf_counter()
        for _ in range(args.repeats):
            torch.topk(x, K, dim=-1)
        torch.cuda.synchronize()
        t_topk = (time.perf_counter() - start) / args.repeats
        cells = [f"{name} {rows}x{n}", *(f"{t[key] * 1e3:.2f} ms" for key in ("ts", "tu", "ps", "pu")),
                 f"{t_paper * 1e3:.2f} ms", f"{t_topk * 1e3:.3f} ms", f"{t['ps'] / t['ts']:.1f}x",
                 f"{t['pu'] / t['tu']:.1f}x", f"{t_paper / t['ts']:.1f}x"]
        print("| " + " | ".join(cells) + " |", flush=True)


def bench_shape(name, args):
    rows, n = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    x = make_scores(name, rows, n, gen)
    w = torch.randn(rows, n, K, generator=gen)
    ours_sorted = lambda z: soft_topk(z, K, epsilon=EPS, sorted=True, scaling="paper")  # noqa: E731
    ours_unsorted = lambda z: soft_topk(z, K, epsilon=EPS, scaling="paper")  # noqa: E731
    ours_torch = lambda z: soft_topk(z, K, epsilon=EPS, sorted=True, scaling="paper", backend="torch")  # noqa: E731
    paper = lambda z: paper_sorted_soft_topk(z, K, epsilon=EPS, max_iter=200)  # noqa: E731
    t_sorted = median_time(fwd_bwd(ours_sorted, x, w), args.repeats)
    t_torch = median_time(fwd_bwd(ours_torch, x, w), args.repeats)
    t_paper = median_time(fwd_bwd(paper, x, w), args.repeats)
    t_unrolled = float("nan")
    if not args.no_unrolled and rows * n <= 300_000:
        t_unrolled = median_time(fwd_bwd(unrolled_sinkhorn, x, w), max(1, args.repeats // 2))
    t_topk = median_time(lambda: torch.topk(x, K, dim=-1), args.repeats)
    # Peers of the unsorted operator, forward + backward each, timed in turn (interleaved_medians): our PyTorch
    # path and entmax's 50-iteration bisection (a sparse top-k mask) -- fast ops, so many repeats; then the
    # perturbed top-k (10 and 100 samples, Monte-Carlo backward).
    peers = {"ours": fwd_bwd(ours_unsorted, x, w),
             "torch": fwd_bwd(lambda z: soft_topk(z, K, epsilon=EPS, scaling="paper", backend="torch"), x, w)}
    if budget_bisect is not None:
        peers["bisect"] = fwd_bwd(lambda z: budget_bisect(z, K), x, w)
    t_peers = interleaved_medians(peers, args.peer_repeats)
    t_unsorted, t_unsorted_torch = t_peers["ours"], t_peers["torch"]
    t_bisect = t_peers.get("bisect", float("nan"))
    t_perturbed = {samples: median_time(fwd_bwd(lambda z: perturbed_topk(z, K, sigma=EPS, samples=samples), x, w),
                                        max(1, args.repeats // 2)) for samples in (10, 100)}

    def fwd_of(op):
        def run():
            xg = x.clone().requires_grad_()
            return op(xg), w, xg
        return run

    mem_ours = peak_backward_bytes(fwd_of(ours_sorted))
    mem_paper = peak_backward_bytes(fwd_of(paper))
    with torch.no_grad():
        ref = soft_topk(x.double(), K, epsilon=EPS, sorted=True, scaling="paper", tol=1e-13, max_iter=200)
        err_ours = (ours_sorted(x).double() - ref).abs().max().item()
        # The authors' code solves another problem (cost scaled by the batch-wide maximum): compare it
        # with that problem solved to convergence, i.e. one temperature eps * M_batch / 2 for all rows.
        x64 = x.double()
        m_batch = torch.maximum(x64.square(), (x64 - K).square()).max().item()
        ref_paper = soft_topk(x64, K, epsilon=EPS * m_batch / 2, sorted=True, tol=1e-13, max_iter=200)
        err_paper = (paper(x).double() - ref_paper).abs().max().item()
    cells = [f"{name} {rows}x{n}", f"{t_sorted * 1e3:.1f} ms", f"{t_unsorted * 1e3:.1f} ms",
             f"{t_torch * 1e3:.1f} ms", f"{t_paper * 1e3:.1f} ms", f"{t_unrolled * 1e3:.1f} ms", f"{t_topk * 1e3:.2f} ms",
             f"{t_paper / t_sorted:.1f}x", f"{mem_ours / 2**20:.1f} MiB", f"{mem_paper / 2**20:.1f} MiB",
             f"{err_ours:.1e}", f"{err_paper:.1e}", f"{t_unsorted_torch * 1e3:.1f} ms",
             f"{t_bisect * 1e3:.1f} ms" if budget_bisect else "-",
             f"{t_bisect / t_unsorted:.1f}x" if budget_bisect else "-", f"{t_perturbed[10] * 1e3:.1f} ms",
             f"{t_perturbed[100] * 1e3:.1f} ms"]
    print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
