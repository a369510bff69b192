"""Where one soft_beam_search update spends its time: torch.profiler over one update (after a warm-up) of
the demo-size model on the benchmarks' batch (``benchmarks/training_step.py``), the top operators by self CPU and self device time, and
the number of host-device synchronisations (``aten::_local_scalar_dense``: ``.item()``, ``bool(tensor)``; the
optimizer step's reads of its CPU step counters left out).

    python scripts/gpu/profile_soft_beam.py --device cuda [--arch lstm] [--rho 0.8] [--candidates 50]

With ``--cprofile`` it also prints where the *host* time of an update goes by Python function (cProfile,
cumulative, our package and fairseq only) -- on a GPU the update is bound by the host issuing operations.
"""
import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
from training_step import (Update, add_batch_arguments, batch_config, build_model_and_sample,  # noqa: E402
                           soft_beam_criterion)


SCALAR_READ = "aten::_local_scalar_dense"  # .item(), bool(tensor): a synchronisation when the tensor is on a device


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="lstm")
    p.add_argument("--rho", type=float, default=0.8)
    p.add_argument("--candidates", type=int, default=50)
    p.add_argument("--rows", type=int, default=15, help="operators listed per table")
    p.add_argument("--cprofile", action="store_true", help="also the host time by Python function (cProfile)")
    add_batch_arguments(p, repeats=1)
    a = p.parse_args()
    from torch.profiler import ProfilerActivity, profile

    model, task, sample, device = build_model_and_sample(dict(batch_config(a), arch=a.arch))
    criterion = soft_beam_criterion(task, teacher_forcing_ratio=a.rho, soft_beam_candidates=a.candidates)
    update = Update(model, criterion, sample, device)
    optimizer = update.optimizer

    update()  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        update()
    events = prof.key_averages()
    reads = sum(e.count for e in events if e.key == SCALAR_READ)
    # Adam reads its step counters (CPU tensors unless capturable) with .item() too: the same profiler event,
    # but no wait for the device (on an H200, 44 of the 77 reads of a soft beam-search update; its teacher
    # forcing's 45 held the same 44). Counted on the optimizer step alone and left out.
    optimizer.zero_grad()
    criterion(model, sample)[0].backward()
    with profile(activities=[ProfilerActivity.CPU]) as step_prof:
        optimizer.step()
    step_reads = sum(e.count for e in step_prof.key_averages() if e.key == SCALAR_READ)
    print(f"{a.arch}, rho {a.rho}, M {a.candidates}, {device}: host-device synchronisations per update: "
          f"{reads - step_reads} ({reads} scalar reads, less the optimizer step's {step_reads} of its CPU step "
          "counters)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=a.rows))
    if device.type == "cuda":
        print(events.table(sort_by="self_device_time_total", row_limit=a.rows))
    if a.cprofile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        update()
        profiler.disable()
        stats = pstats.Stats(profiler).sort_stats("cumulative")
        print("host time by function (cProfile, cumulative seconds; one update):")
        stats.print_stats(r"softtopk_fairseq|fairseq/models|fairseq/criterions|torch/autograd|optim", 2 * a.rows)


if __name__ == "__main__":
    main()
