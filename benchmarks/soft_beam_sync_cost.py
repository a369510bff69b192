"""What soft_topk's host synchronisations per call cost a soft beam-search update.

Three updates of the same model (same seed, each its own copy and Adam) on bench_soft_beam's batch, timed
alternately in one process, median of ``--repeats`` rounds after ``--warmup`` untimed ones: teacher forcing
(``label_smoothed_cross_entropy``), the ``sum`` update (rho 0.8, M 50, paper scaling, teacher forcing in the
search) as the search runs it -- soft_topk with ``check_errors=False``, nothing read back per step -- and the same
update with soft_topk's two per-call checks made, as the search made them until the twenty-fifth session: the
Triton backend's read of the rows' status bits and the max_iter warning's read of the iteration counts
(:func:`checks_made`).

    python benchmarks/soft_beam_sync_cost.py --device cuda --threads 8 [--repeats 25]

On an H200, skipping the two checks (then by a monkeypatch) saved 3.6 ms of 74.4 (docs/results.md, "On a GPU,
third measurements"). On CPU the C backend's status is no synchronisation and only the warning's read differs.
"""
import argparse
import contextlib
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_soft_beam import (add_batch_arguments, batch_config, build_model_and_sample, timed_update,  # noqa: E402
                             warmup_updates)


@contextlib.contextmanager
def checks_made():
    """The search's soft_topk calls with ``check_errors=True`` (two host reads each); restored on exit."""
    from softtopk_fairseq.modules.soft_beam_search import OptimalTransport

    OptimalTransport.check_errors = True
    try:
        yield
    finally:
        OptimalTransport.check_errors = False


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="lstm")
    add_batch_arguments(p, repeats=25)
    a = p.parse_args()
    import torch
    from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

    from softtopk_fairseq.criterions.soft_beam_search import SoftBeamSearchConfig, SoftBeamSearchCriterion

    cfg = dict(batch_config(a), arch=a.arch)
    updates = {}
    for name in ("teacher forcing", "sum", "sum, checks made"):
        model, task, sample, device = build_model_and_sample(cfg)
        criterion = (LabelSmoothedCrossEntropyCriterion(task, False, 0.1) if name == "teacher forcing" else
                     SoftBeamSearchCriterion(task, SoftBeamSearchConfig(
                         sentence_avg=False, label_smoothing=0.1, teacher_forcing_ratio=0.8,
                         soft_beam_candidates=50, soft_topk_scaling="paper", teacher_forcing_pass="search")))
        context = checks_made if name.endswith("made") else contextlib.nullcontext
        updates[name] = (model, criterion, sample, torch.optim.Adam(model.parameters(), lr=1e-4), context, [])
    warmup = warmup_updates(cfg)
    for round_ in range(warmup + a.repeats):
        for model, criterion, sample, optimizer, context, times in updates.values():
            with context():
                seconds, _ = timed_update(model, criterion, sample, optimizer, device)
            if round_ >= warmup:
                times.append(seconds)
    print(f"{a.arch}, batch {a.bsz} x (src {a.src_len}, tgt {a.tgt_len}), vocab {a.vocab}, beam 5, M 50, {device}, "
          f"{a.threads} threads, median of {a.repeats} alternating rounds after {warmup}")
    print("| update | ms (median) | ms (min) | x teacher forcing |\n|---|---|---|---|")
    base = statistics.median(updates["teacher forcing"][-1])
    for name, (*_, times) in updates.items():
        print(f"| {name} | {statistics.median(times) * 1e3:.1f} | {min(times) * 1e3:.1f} "
              f"| {statistics.median(times) / base:.2f} |")


if __name__ == "__main__":
    main()
