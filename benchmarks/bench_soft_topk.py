"""Speed, memory and accuracy of soft_topk against the paper's code, measured side by side in one run.

    .venv/bin/python benchmarks/bench_soft_topk.py [--shapes generic attention beam] [--repeats 5]

For each shape (rows x n, k = 5, float32, forward + backward of a random linear loss) it prints the
median time of: our sorted and unsorted op (Newton + closed-form backward; ``backend="auto"``, which on CPU
runs the sorted op in the fused C kernels of ``cpu_kernels.py``), our sorted op on the eager PyTorch path
(``backend="torch"``), a faithful re-implementation of
the authors' code (fixed 200 Sinkhorn iterations + their backward, ``paper_reference.py``), autograd through
the same 200 unrolled log-domain Sinkhorn iterations, and hard ``torch.topk``; the speed-up of our sorted op
over the paper's code; peak memory allocated during the backward; and the max abs error of the sorted output
against a float64 solution converged to 1e-13 of the problem each one solves (the paper's scaling, epsilon
0.1: per row for ours, batch-wide for the authors' code). On a GPU it also times the fused Triton kernels
against our PyTorch path at the beam shape.
"""
import argparse
import statistics
import time

import torch

from softtopk_fairseq.ops import soft_topk
from softtopk_fairseq.ops.paper_reference import paper_sorted_soft_topk

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
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--no-unrolled", action="store_true", help="skip autograd through unrolled Sinkhorn")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, k={K}, eps={EPS} "
          f"(paper scaling), forward+backward, median of {args.repeats}")
    header = ("shape", "ours sorted", "ours unsorted", "ours sorted torch path", "paper 200it", "unrolled 200it", "torch.topk",
              "paper/ours", "bwd peak ours", "bwd peak paper", "err ours", "err paper")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name in args.shapes:
        bench_shape(name, args)
    if torch.cuda.is_available():
        bench_gpu(args)


def bench_gpu(args):
    """On a GPU: fused Triton kernels against our PyTorch path and the paper's code, beam shape."""
    rows, n = SHAPES["beam"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.log_softmax(3 * torch.randn(rows, n, device="cuda", generator=gen), dim=-1)
    w = torch.randn(rows, n, K, device="cuda", generator=gen)

    def timed(op):
        run = fwd_bwd(op, x, w)
        run()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    t_triton = timed(lambda z: soft_topk(z, K, epsilon=EPS, sorted=True, scaling="paper", backend="triton"))
    t_torch = timed(lambda z: soft_topk(z, K, epsilon=EPS, sorted=True, scaling="paper", backend="torch"))
    t_paper = timed(lambda z: paper_sorted_soft_topk(z, K, epsilon=EPS, max_iter=200))
    print(f"\nGPU {torch.cuda.get_device_name()} beam {rows}x{n}, sorted, fwd+bwd: triton {t_triton * 1e3:.2f} ms, "
          f"torch path {t_torch * 1e3:.2f} ms ({t_torch / t_triton:.1f}x), paper {t_paper * 1e3:.2f} ms "
          f"({t_paper / t_triton:.1f}x)")


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
    t_unsorted = median_time(fwd_bwd(ours_unsorted, x, w), args.repeats)
    t_torch = median_time(fwd_bwd(ours_torch, x, w), args.repeats)
    t_paper = median_time(fwd_bwd(paper, x, w), args.repeats)
    t_unrolled = float("nan")
    if not args.no_unrolled and rows * n <= 300_000:
        t_unrolled = median_time(fwd_bwd(unrolled_sinkhorn, x, w), max(1, args.repeats // 2))
    t_topk = median_time(lambda: torch.topk(x, K, dim=-1), args.repeats)

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
             f"{err_ours:.1e}", f"{err_paper:.1e}"]
    print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
