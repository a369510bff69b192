"""Where a soft beam-search update's time goes by phase -- the criterion's forward, the backward, the optimizer
step -- against teacher forcing, how many kernels each update launches, and what soft_topk's host reads cost.

Four updates of the same model (same seed, each its own copy and Adam) on the benchmarks' batch
(``benchmarks/training_step.py``), timed alternately in one process, each phase finished on the device before the
next starts (median of ``--repeats`` rounds after ``--warmup`` untimed ones): teacher forcing
(``label_smoothed_cross_entropy``); the ``sum`` update (rho 0.8, M 50, paper scaling, teacher forcing in the
search) as the search runs it -- soft_topk with ``check_errors=False``, nothing read back per step --; the same
update with soft_topk's two per-call checks made (the relaxation ``soft_topk_checked`` registered here,
``--soft-beam-relaxation soft_topk_checked``: the Triton backend's read of the rows' status bits, the max_iter
warning's read of the iteration counts); and the ``sum`` update with ``--soft-beam-cuda-graphs`` (each step's work
between two decoder calls as CUDA graphs; eager off CUDA). On a GPU the launches are counted with torch.profiler
over one more update of each (the runtime's kernel-launch calls, PyTorch's and Triton's, and its graph launches).

    python scripts/gpu/soft_beam_phases.py --device cuda --threads 8 [--repeats 20] [--bsz 128]
"""
import argparse
import os
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import harness  # noqa: E402
from training_step import (TEACHER_FORCING, adam, add_batch_arguments, batch_config,  # noqa: E402
                           build_model_and_sample, update_criterion, warmup_updates)

from softtopk_fairseq.modules import relaxations  # noqa: E402

PHASES = ("forward", "backward", "step")
# The CUDA runtime / driver calls that launch a kernel (cuLaunchKernel*: Triton's launcher), or a CUDA graph (one
# call for all of its kernels).
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


@relaxations.register
class CheckedSoftTopK(relaxations.OptimalTransport):
    """The search's SOFT top-k with soft_topk's checks made (``check_errors=True``: two host reads per call, a
    refused row an error): what the checks cost, measured against the search's own ``soft_topk``."""

    name = "soft_topk_checked"
    check_errors = True


UPDATES = {TEACHER_FORCING: dict(name=TEACHER_FORCING), "sum": dict(name="sum"),
           "sum, checks made": dict(name="sum", relaxation=CheckedSoftTopK.name),
           "sum, CUDA graphs": dict(name="sum, CUDA graphs")}


def timed_phases(model, criterion, sample, optimizer, device):
    """Seconds of each phase of one update, the device synchronised around each."""
    optimizer.zero_grad()
    harness.synchronize(device)
    marks = [time.perf_counter()]
    loss = criterion(model, sample)[0]
    harness.synchronize(device)
    marks.append(time.perf_counter())
    loss.backward()
    harness.synchronize(device)
    marks.append(time.perf_counter())
    optimizer.step()
    harness.synchronize(device)
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
    cfg = dict(batch_config(a), arch=a.arch)
    updates = {}
    for label, kind in UPDATES.items():
        model, task, sample, device = build_model_and_sample(cfg)
        criterion = update_criterion(kind["name"], task, kind.get("relaxation", "soft_topk"))
        updates[label] = (model, criterion, sample, adam(model), [])
    warmup = warmup_updates(cfg)
    for round_ in range(warmup + a.repeats):
        for model, criterion, sample, optimizer, times in updates.values():
            seconds = timed_phases(model, criterion, sample, optimizer, device)
            if round_ >= warmup:
                times.append(seconds)
    counted = device.type == "cuda"
    print(f"{a.arch}, batch {a.bsz} x (src {a.src_len}, tgt {a.tgt_len}), vocab {a.vocab}, beam 5, M 50, {device}, "
          f"{a.threads} threads, median of {a.repeats} alternating rounds after {warmup}, each phase synchronised")
    print(harness.table_header(("update", "forward ms", "backward ms", "step ms", "total ms", "x teacher forcing",
                                "kernel launches")))
    base = None
    for name, (model, criterion, sample, optimizer, times) in updates.items():
        phases = [statistics.median(t[i] for t in times) * 1e3 for i in range(len(PHASES))]
        total = statistics.median(sum(t) for t in times) * 1e3
        base = base or total
        count = launches(model, criterion, sample, optimizer) if counted else "-"
        print(harness.table_row((name, *(f"{x:.1f}" for x in phases), f"{total:.1f}", f"{total / base:.2f}", count)))


if __name__ == "__main__":
    main()
