"""Where a soft beam-search update's time goes by phase -- the criterion's forward, the backward, the optimizer
step -- against teacher forcing, how many kernels each update launches, and what soft_topk's host reads cost.

Three updates of the same model (same seed, each its own copy and Adam) on bench_soft_beam's batch, timed
alternately in one process, each phase finished on the device before the next starts (median of ``--repeats``
rounds after ``--warmup`` untimed ones): teacher forcing (``label_smoothed_cross_entropy``), the ``sum`` update
(rho 0.8, M 50, paper scaling, teacher forcing in the search) as the search runs it -- soft_topk with
``check_errors=False``, nothing read back per step -- and the same update with soft_topk's two per-call checks
made, as the search made them until the twenty-fifth session (:func:`checks_made`: the Triton backend's read of
the rows' status bits, the max_iter warning's read of the iteration counts), and the ``sum`` update with
``--soft-beam-cuda-graphs`` (each step's work between two decoder calls as CUDA graphs; eager off CUDA). On a GPU
the launches are counted with torch.profiler over one more update of each (the runtime's kernel-launch calls,
PyTorch's and Triton's, and its graph launches).

    python benchmarks/soft_beam_phases.py --device cuda --threads 8 [--repeats 20] [--bsz 128]

(It replaces soft_beam_sync_cost.py, which timed the same three updates whole; docs/results.md has both.)
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_soft_beam import (add_batch_arguments, batch_config, build_model_and_sample, update_criterion,  # noqa: E402
                             warmup_updates)

PHASES = ("forward", "backward", "step")
# The CUDA runtime / driver calls that launch a kernel (cuLaunchKernel*: Triton's launcher), or a CUDA graph (one
# call for all of its kernels).
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


@contextlib.contextmanager
def checks_made():
    """The search's soft_topk calls with ``check_errors=True`` (two host reads each); restored on exit."""
    from softtopk_fairseq.modules.soft_beam_search import OptimalTransport

    OptimalTransport.check_errors = True
    try:
        yield
    finally:
        OptimalTransport.check_errors = False


def timed_phases(model, criterion, sample, optimizer, device):
    """Seconds of each phase of one update, the device synchronised around each."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    optimizer.zero_grad()
    sync()
    marks = [time.perf_counter()]
    loss = criterion(model, sample)[0]
    sync()
    marks.append(time.perf_counter())
    loss.backward()
    sync()
    marks.append(time.perf_counter())
    optimizer.step()
    sync()
    marks.append(time.perf_counter())
    return [b - a for a, b in zip(marks, marks[1:])]


def launches(model, criterion, sample, optimizer):
    """Kernel launches of one update (CUDA: the profiler's launch calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_phases(model, criterion, sample, optimizer, sample["target"].device)
    return sum(e.count for e in prof.key_averages() if e.key in LAUNCHES)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="lstm")
    add_batch_arguments(p, repeats=20)
    a = p.parse_args()
    import torch

    cfg = dict(batch_config(a), arch=a.arch)
    updates = {}
    for name in ("teacher forcing", "sum", "sum, checks made", "sum, CUDA graphs"):
        model, task, sample, device = build_model_and_sample(cfg)
        criterion = update_criterion(name, task)
        context = checks_made if name.endswith("made") else contextlib.nullcontext
        updates[name] = (model, criterion, sample, torch.optim.Adam(model.parameters(), lr=1e-4), context, [])
    warmup = warmup_updates(cfg)
    for round_ in range(warmup + a.repeats):
        for model, criterion, sample, optimizer, context, times in updates.values():
            with context():
                seconds = timed_phases(model, criterion, sample, optimizer, device)
            if round_ >= warmup:
                times.append(seconds)
    counted = device.type == "cuda"
    print(f"{a.arch}, batch {a.bsz} x (src {a.src_len}, tgt {a.tgt_len}), vocab {a.vocab}, beam 5, M 50, {device}, "
          f"{a.threads} threads, median of {a.repeats} alternating rounds after {warmup}, each phase synchronised")
    print("| update | forward ms | backward ms | step ms | total ms | x teacher forcing | kernel launches |\n"
          "|---|---|---|---|---|---|---|")
    base = None
    for name, (model, criterion, sample, optimizer, context, times) in updates.items():
        phases = [statistics.median(t[i] for t in times) * 1e3 for i in range(len(PHASES))]
        total = statistics.median(sum(t) for t in times) * 1e3
        base = base or total
        with context():
            count = launches(model, criterion, sample, optimizer) if counted else "-"
        print(f"| {name} | {' | '.join(f'{x:.1f}' for x in phases)} | {total:.1f} | {total / base:.2f} | {count} |")


if __name__ == "__main__":
    main()
