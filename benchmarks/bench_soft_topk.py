"""Speed, memory and accuracy of soft_topk against the hard top-k, the paper's code and its peers, side by side in
one run.

    .venv/bin/python benchmarks/bench_soft_topk.py [--shapes generic attention beam] [--repeats 5] [--json PATH]
    .venv/bin/python benchmarks/bench_soft_topk.py --tables floor [--floor-rounds 21] [--peers ...]  # the targets
    .venv/bin/python benchmarks/bench_soft_topk.py --tables against_n --plot docs/figures/operator_time_vs_n.png
    .venv/bin/python benchmarks/bench_soft_topk.py --device cuda [--repeats 10]

``floor`` (the first table): the operator as the README calls it -- ``soft_topk(scores, k, epsilon=0.1)``, the
temperature in the scores' units -- against the hard top-k itself, ``torch.zeros_like(x).scatter_(-1,
x.topk(k).indices, 1)`` (its forward only: the floor a differentiable top-k is measured against), and the peers
with a gradient: entmax's ``budget_bisect``, the perturbed top-k (10 and 100 samples) and difftopk's bitonic
sorting network (Petersen et al. 2022, ``difftopk``; it holds a dense n x n matrix per row and layer: run up to
64 MiB a layer); ``--peers`` picks them. Every row forward + backward of a random linear loss (its gradient handed
to the output's backward). The hard top-k and our unsorted and sorted op are timed in turn, alone, in
``--floor-rounds`` rounds after a warm-up (medians); each peer in turn with ours unsorted (the slow ones in a
seventh of the rounds), so that every ratio comes from one set of rounds and no peer's working set sits between
the target's calls. It prints the ratios to the hard top-k, of the sorted operator to the unsorted one and of each
peer to ours, at k = 5, the unsorted one's ratio at other k (``--floor-k``) and, on a CPU, whether each of
``CPU_TARGETS`` is met. ``against_n``:
the same rows at 64 rows and n from 32 to 10,000 (k = 5; ``--against-n``), with the authors' code, and ``--plot
PATH`` draws time against n.

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
import contextlib
import io
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
try:  # difftopk's differentiable sorting networks (the `bench` extra), else its rows are "-"
    with contextlib.redirect_stdout(io.StringIO()):  # it prints that an optional torch_sparse is missing
        import difftopk
except ImportError:  # pragma: no cover
    difftopk = None

EPS = 0.1
CPU_COLUMNS = ("shape", "ours sorted", "ours unsorted", "ours sorted torch path", "paper 200it", "unrolled 200it",
               "torch.topk", "paper/ours", "bwd peak ours", "bwd peak paper", "err ours", "err paper",
               "ours unsorted torch path", "entmax budget_bisect", "budget_bisect/ours unsorted",
               "perturbed 10 unsorted", "perturbed 100 unsorted")
GPU_COLUMNS = ("shape", "triton sorted", "triton unsorted", "torch path sorted", "torch path unsorted",
               "paper 200it", "torch.topk", "torch/triton sorted", "torch/triton unsorted", "paper/triton")


FLOOR_COLUMNS = ("shape", "hard top-k (forward)", "ours unsorted", "/ hard", "ours sorted", "sorted / unsorted",
                 "budget_bisect", "/ ours", "perturbed 10", "/ ours", "perturbed 100", "/ ours", "difftopk bitonic",
                 "/ ours")
DIFFTOPK_MAX_BYTES = 64 * 2**20  # difftopk's dense n x n matrix per row and layer: at most this much per layer
PEERS = ("budget_bisect", "perturbed", "difftopk")


def hard_topk_mask(x, k=K):
    """The hard top-k as a mask: what a differentiable top-k relaxes, and the floor of its cost."""
    return torch.zeros_like(x).scatter_(-1, x.topk(k).indices, 1)


def readme_call(sorted, k=K):
    """The operator as the README calls it: epsilon 0.1 in the scores' units."""
    return lambda z: soft_topk(z, k, epsilon=EPS, sorted=sorted)


def difftopk_call(rows, n, k=K):
    """difftopk's bitonic sorting network (steepness 10, its default) on (rows, n), or None with why not (not
    installed, or a dense layer of rows x n x n floats over DIFFTOPK_MAX_BYTES)."""
    if difftopk is None:
        return None, "difftopk is not installed (the bench extra)"
    if rows * n * n * 4 > DIFFTOPK_MAX_BYTES:
        return None, (f"not run at {rows}x{n}: its network holds a dense {n} x {n} matrix per row and layer, "
                      f"{rows * n * n * 4 / 2**30:.1f} GiB per layer")
    size = 1 << max(0, (n - 1).bit_length())  # bitonic networks need a power of two: pad with -inf
    net = difftopk.DiffTopkNet("bitonic", size, k, device="cpu")

    def call(z):
        padded = z if size == n else torch.cat([z, z.new_full((rows, size - n), -1e9)], -1)
        return net(padded)[1][:, :n]  # (rows, n, k): element j at rank l

    return call, None


def floor_rows(x, w, peers=PEERS, k=K):
    """The floor table's rows on scores x, with the peers named: row -> one forward (+ backward) call."""
    rows_, n = x.shape
    calls = {"hard top-k": lambda: hard_topk_mask(x, k),
             "ours unsorted": forward_backward(readme_call(False, k), x, w),
             "ours sorted": forward_backward(readme_call(True, k), x, w)}
    if budget_bisect is not None and "budget_bisect" in peers:
        calls["budget_bisect"] = forward_backward(lambda z: budget_bisect(z, k), x, w)
    for samples in (10, 100) if "perturbed" in peers else ():
        calls[f"perturbed {samples}"] = forward_backward(
            lambda z, samples=samples: perturbed_topk(z, k, sigma=EPS, samples=samples), x, w)
    sorting_network, _ = difftopk_call(rows_, n, k) if "difftopk" in peers else (None, None)
    if sorting_network is not None:
        calls["difftopk bitonic"] = forward_backward(sorting_network, x, w)
    return calls


TARGETS = ("hard top-k", "ours unsorted", "ours sorted")  # the floor table's group: timed in turn, alone
# The CPU speed targets, as ratios in the floor table: (shape, row) -> the largest ratio to the row's baseline (ours
# unsorted against the hard top-k, ours sorted against ours unsorted) that meets the target.
CPU_TARGETS = {("generic", "ours unsorted"): 3.0, ("attention", "ours unsorted"): 1.3,
               ("generic", "ours sorted"): 6.0, ("attention", "ours sorted"): 6.0}
SLOW = ("perturbed 100", "difftopk", "authors")  # rows timed in fewer rounds


def time_floor_rows(calls, rounds):
    """``calls`` (floor_rows, maybe more) timed in groups, each in turn in one process: the targets' three calls
    alone (so that no peer's working set stands between them), the fast peers with ours unsorted, the slow ones
    (SLOW) with ours unsorted in a seventh of the rounds. Returns row -> (seconds, baseline row or None, the
    baseline's seconds in the row's group)."""
    targets = {row: calls[row] for row in TARGETS}
    group = harness.compare(("hard top-k", targets.pop("hard top-k")), targets, rounds)
    timed = {"hard top-k": (group.seconds("hard top-k"), None, None),
             "ours unsorted": (group.seconds("ours unsorted"), "hard top-k", group.seconds("hard top-k")),
             "ours sorted": (group.seconds("ours sorted"), "ours unsorted", group.seconds("ours unsorted"))}
    peers = [row for row in calls if row not in TARGETS]
    for names, n_rounds in (([r for r in peers if not r.startswith(SLOW)], rounds),
                            ([r for r in peers if r.startswith(SLOW)], max(1, rounds // 7))):
        if names:
            group = harness.compare(("ours unsorted", calls["ours unsorted"]), {r: calls[r] for r in names}, n_rounds)
            timed.update({r: (group.seconds(r), "ours unsorted", group.seconds("ours unsorted")) for r in names})
    return timed


def bench_floor(args, results):
    """The operator against the hard top-k and its peers (module docstring), with the targets' ratios."""
    print(f"\nThe differentiable top-k against the hard one: torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, float32, k={K}, soft_topk(scores, k, epsilon={EPS}) (the README's call), forward + backward "
          f"(the hard top-k: forward). The hard top-k and ours timed in turn, {args.floor_rounds} rounds, medians; "
          f"each peer in turn with ours unsorted, its ratio to ours from those rounds")
    print(harness.table_header(FLOOR_COLUMNS))
    notes, targets = [], []
    for name in args.shapes:
        rows_, n = SHAPES[name]
        shape = f"{name} {rows_}x{n}"
        gen = torch.Generator().manual_seed(0)
        x = operator_scores(name, rows_, n, gen)
        w = torch.randn(rows_, n, K, generator=gen)
        timed = time_floor_rows(floor_rows(x, w, args.peers), args.floor_rounds)
        ratios = {row: seconds / base_seconds for row, (seconds, _, base_seconds) in timed.items() if base_seconds}
        for row, (seconds, base, base_seconds) in timed.items():
            results.add(row, seconds, shape=shape, baseline=base, baseline_seconds=base_seconds, table="floor",
                        **({"pass": "forward"} if row == "hard top-k" else {}))
        if args.device == "cpu":
            for (target_shape, row), bound in CPU_TARGETS.items():
                if target_shape == name:
                    got = ratios[row]
                    targets.append(f"target: {row} <= {bound:g}x {timed[row][1]} at {shape}: "
                                   f"{'met' if got <= bound else 'NOT met'} ({got:.2f}x)")
        _, why = difftopk_call(rows_, n)
        if why and "difftopk" in args.peers:
            notes.append(f"difftopk at {shape}: {why}")

        def ms(row):
            return f"{timed[row][0] * 1e3:.2f} ms" if row in timed else "-"

        def ratio(row, digits=1):
            return f"{ratios[row]:.{digits}f}x" if row in ratios else "-"

        print(harness.table_row([
            shape, ms("hard top-k"), ms("ours unsorted"), ratio("ours unsorted", 2), ms("ours sorted"),
            ratio("ours sorted"), ms("budget_bisect"), ratio("budget_bisect"), ms("perturbed 10"),
            ratio("perturbed 10"), ms("perturbed 100"), ratio("perturbed 100"), ms("difftopk bitonic"),
            ratio("difftopk bitonic", 0)]), flush=True)
        for k in args.floor_k:
            if k == K or k >= n:
                continue
            kk = harness.compare(("hard top-k", lambda k=k: hard_topk_mask(x, k)),
                                 {"ours unsorted": forward_backward(readme_call(False, k), x, w)}, args.floor_rounds)
            results.add("ours unsorted", kk.seconds("ours unsorted"), shape=shape, baseline="hard top-k",
                        baseline_seconds=kk.seconds("hard top-k"), table="floor", k=k)
            notes.append(f"{shape}, k = {k}: ours unsorted {kk.seconds('ours unsorted') * 1e3:.2f} ms, "
                         f"{kk.ratio('ours unsorted'):.2f}x the hard top-k ({kk.seconds('hard top-k') * 1e3:.2f} ms)")
    small, small_target = bench_small_call(args, results)
    for line in notes + [small] + targets + [small_target]:
        print(f"- {line}")


# The host cost of a small call: the README's call on 4 x 16 scores, forward + backward, with and without
# check_errors; without must not cost more (the floor table's CPU target, with room for the rounds' noise).
SMALL_CALL = (4, 16)
SMALL_CALL_TARGET = 1.1


def bench_small_call(args, results):
    """The floor table's small-call row: check_errors=False timed in turn with check_errors=True, and its target
    (printed line)."""
    x = torch.randn(*SMALL_CALL, generator=torch.Generator().manual_seed(0))
    w = torch.randn(*SMALL_CALL, K, generator=torch.Generator().manual_seed(1))
    calls = {checked: forward_backward(lambda z, checked=checked: soft_topk(z, K, epsilon=EPS, check_errors=checked),
                                       x, w) for checked in (True, False)}
    timed = harness.compare(("check_errors=True", calls[True]), {"check_errors=False": calls[False]},
                            args.floor_rounds * 10)
    shape = f"small {SMALL_CALL[0]}x{SMALL_CALL[1]}"
    for row in ("check_errors=True", "check_errors=False"):
        results.add(f"ours unsorted {row}", timed.seconds(row), shape=shape, table="floor",
                    baseline=None if row.endswith("True") else "ours unsorted check_errors=True",
                    baseline_seconds=None if row.endswith("True") else timed.seconds("check_errors=True"))
    got = timed.ratio("check_errors=False")
    return (f"{shape}, the host cost of a small call: ours unsorted {timed.seconds('check_errors=True') * 1e6:.0f} us "
            f"with check_errors, {timed.seconds('check_errors=False') * 1e6:.0f} us without",
            f"target: check_errors=False <= {SMALL_CALL_TARGET:g}x check_errors=True at {shape}: "
            f"{'met' if got <= SMALL_CALL_TARGET else 'NOT met'} ({got:.2f}x)")


# The call-cost table: the operator at the sizes a training step calls it (the top-k attention's, the beam
# search's, a vocabulary-sized batch) against the hard top-k mask, and the GPU targets on the ratios (row, baseline
# row) -> the largest ratio that meets the target.
CALL_COST_SHAPES = {**SHAPES, "vocabulary": (256, 32000)}
CALL_COST_TARGETS = {("unsorted unchecked", "hard top-k"): 2.0, ("unsorted", "hard top-k"): 3.0,
                     ("sorted", "unsorted"): 2.0}
CALL_COST_COLUMNS = ("shape", "hard top-k (forward)", "unsorted", "/ hard", "unsorted unchecked", "/ hard",
                     "sorted", "/ unsorted")


def bench_call_cost(args, results):
    """The call-cost table (CALL_COST_SHAPES): hard mask, unsorted (with and without check_errors) and sorted
    soft_topk, forward + backward, timed in turn (on a GPU with CUDA events around each call, the host's time
    included whenever the GPU waits for it); on a GPU, each of CALL_COST_TARGETS met or not."""
    device = args.device
    timer = harness.cuda_event_seconds if device == "cuda" else harness.seconds
    print(f"\nThe call's cost: {device}{' ' + torch.cuda.get_device_name() if device == 'cuda' else ''}, torch "
          f"{torch.__version__}, float32, k={K}, soft_topk(scores, k, epsilon={EPS}), forward + backward (the hard "
          f"top-k: forward), timed in turn, {args.call_cost_rounds} rounds, medians")
    print(harness.table_header(CALL_COST_COLUMNS))
    targets = []
    for name in args.call_cost_shapes:
        rows_, n = CALL_COST_SHAPES[name]
        shape = f"{name} {rows_}x{n}"
        gen = torch.Generator().manual_seed(0)
        x = operator_scores(name, rows_, n, gen).to(device)
        w = torch.randn(rows_, n, K, generator=gen).to(device)
        timed = harness.compare(("hard top-k", lambda: hard_topk_mask(x)), {
            "unsorted": forward_backward(readme_call(False), x, w),
            "unsorted unchecked": forward_backward(lambda z: soft_topk(z, K, epsilon=EPS, check_errors=False), x, w),
            "sorted": forward_backward(readme_call(True), x, w)}, args.call_cost_rounds, device=device, timer=timer)
        t = {row: timed.seconds(row) for row in timed.times}
        for row in t:
            base = next((b for (r, b) in CALL_COST_TARGETS if r == row), None)
            results.add(row, t[row], shape=shape, table="call_cost", baseline=base,
                        baseline_seconds=t[base] if base else None, **({"pass": "forward"} if base is None else {}))
        print(harness.table_row([shape, *(f"{t[row] * 1e3:.3f} ms" + (f" | {t[row] / t[base]:.2f}x" if base else "")
                                          for row, base in (("hard top-k", None), ("unsorted", "hard top-k"),
                                                            ("unsorted unchecked", "hard top-k"),
                                                            ("sorted", "unsorted")))]), flush=True)
        for (row, base), bound in CALL_COST_TARGETS.items():
            got = t[row] / t[base]
            verdict = ("met" if got <= bound else "NOT met") if device == "cuda" else "a GPU target, not checked on CPU"
            targets.append(f"target: {row} <= {bound:g}x {base} at {shape}: {verdict} ({got:.2f}x)")
    for line in targets:
        print(f"- {line}")


AGAINST_N = (32, 100, 316, 1000, 3162, 10000)
AGAINST_N_ROWS = 64


def bench_against_n(args, results):
    """Every row of the floor table and the authors' code at 64 rows and n from 32 to 10,000, k = 5 (module
    docstring); with ``--plot`` the figure."""
    print(f"\nTime against n: {AGAINST_N_ROWS} rows, k={K}, forward + backward (the hard top-k: forward), timed "
          f"as in the floor table ({args.floor_rounds} rounds; the slow rows fewer)")
    series = {}
    for n in args.against_n:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(AGAINST_N_ROWS, n, generator=gen)
        w = torch.randn(AGAINST_N_ROWS, n, K, generator=gen)
        calls = floor_rows(x, w, args.peers)
        calls["authors' code (sorted)"] = forward_backward(paper, x, w)
        timed = time_floor_rows(calls, args.floor_rounds)
        for row, (seconds, base, base_seconds) in timed.items():
            series.setdefault(row, []).append((n, seconds))
            results.add(row, seconds, shape=f"{AGAINST_N_ROWS}x{n}", baseline=base, baseline_seconds=base_seconds,
                        table="against_n")
        print(f"n = {n}: " + ", ".join(f"{row} {t[0] * 1e3:.2f} ms" for row, t in timed.items()), flush=True)
    if args.plot:
        plot_against_n(series, args.plot)
        print(f"plot: {args.plot}")


def plot_against_n(series, path):
    """Time against n, log-log, one line per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for row, points in series.items():
        style = "k--" if row == "hard top-k" else "-o"
        ax.plot([n for n, _ in points], [s * 1e3 for _, s in points], style, label=row, markersize=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"n (scores per row; {AGAINST_N_ROWS} rows, k = {K})")
    ax.set_ylabel("ms, forward + backward")
    ax.set_title(f"soft_topk against the hard top-k and its peers ({torch.get_num_threads()} CPU threads)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
                        help="cuda: the GPU table (Triton kernels against our PyTorch path and the paper's), or "
                             "--tables call_cost")
    parser.add_argument("--tables", nargs="+", default=["floor", "authors"],
                        choices=["floor", "authors", "against_n", "call_cost"],
                        help="CPU tables: floor (against the hard top-k and the peers), authors (against the "
                             "authors' code, the paper scaling), against_n (time against n); call_cost (CPU or "
                             "GPU: the call against the hard top-k mask at training sizes, with the GPU targets)")
    parser.add_argument("--call-cost-rounds", type=int, default=30, help="rounds of the call_cost table")
    parser.add_argument("--call-cost-shapes", nargs="+", default=list(CALL_COST_SHAPES),
                        choices=list(CALL_COST_SHAPES), help="call_cost: the shapes")
    parser.add_argument("--floor-rounds", type=int, default=21, help="rounds of the floor and against_n tables")
    parser.add_argument("--floor-k", type=int, nargs="*", default=[1, 5, 16, 64],
                        help="k of the unsorted operator against the hard top-k (floor table)")
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS,
                        help="floor and against_n: the peers timed beside ours and the hard top-k")
    parser.add_argument("--against-n", type=int, nargs="+", default=list(AGAINST_N), help="against_n: the n")
    parser.add_argument("--plot", help="against_n: the figure of time against n (PNG)")
    harness.add_json_argument(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = harness.Results("bench_soft_topk", args.json, device=args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_soft_topk: --device cuda but torch sees no CUDA device")
    if "call_cost" in args.tables:
        bench_call_cost(args, results)
        if args.tables == ["call_cost"]:
            return
    if args.device == "cuda":
        bench_gpu(args, results)
        return
    if "floor" in args.tables:
        bench_floor(args, results)
    if "authors" in args.tables:
        print(f"\nAgainst the authors' code: torch {torch.__version__}, {torch.get_num_threads()} threads, float32, "
              f"k={K}, eps={EPS} (paper scaling), forward+backward; each group timed alternately with its baseline: "
              f"median of {args.repeats} rounds (unsorted peers: {args.peer_repeats})")
        print(harness.table_header(CPU_COLUMNS))
        for name in args.shapes:
            bench_shape(name, args, results)
    if "against_n" in args.tables:
        bench_against_n(args, results)


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
