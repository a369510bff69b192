"""What soft_topk's two host synchronisations per call cost a soft beam-search update.

Three updates of the same model (same seed, each its own copy and Adam) on bench_soft_beam's batch, timed
alternately in one process, median of ``--repeats`` rounds after ``--warmup`` untimed ones: teacher forcing
(``label_smoothed_cross_entropy``), the ``sum`` update (rho 0.8, M 50, paper scaling, teacher forcing in the
search), and the same update with soft_topk's two per-call checks skipped -- the Triton backend's read of the
rows' status bits (``TritonBackend.raise_for_status``) and the max_iter warning's read of the iteration counts.

    python benchmarks/soft_beam_sync_cost.py --device cuda --threads 8 [--repeats 25]

An experiment, not a mode: skipping the checks is only sound on scores known to be finite (this random batch).
The difference says what a search without those synchronisations could gain -- on an H200, 3.6 ms of 74.4
(docs/results.md, "On a GPU, third measurements"). On CPU the C backend's status is no synchronisation and only
the warning's read is skipped.
"""
import argparse
import contextlib
import importlib
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_soft_beam import (add_batch_arguments, batch_config, build_model_and_sample, timed_update,  # noqa: E402
                             warmup_updates)


@contextlib.contextmanager
def checks_skipped():
    """soft_topk without its two host reads (see the module docstring); restored on exit."""
    from softtopk_fairseq.ops import backends

    # soft_topk the module (softtopk_fairseq.ops re-exports the function under the same name)
    soft_topk_module = importlib.import_module("softtopk_fairseq.ops.soft_topk")
    warn_if_capped = soft_topk_module._warn_if_capped
    backends.TRITON.raise_for_status = lambda status: None  # an instance attribute over the method
    soft_topk_module._warn_if_capped = lambda info, tol, max_iter: None
    try:
        yield
    finally:
        del backends.TRITON.raise_for_status
        soft_topk_module._warn_if_capped = warn_if_capped


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
    for name in ("teacher forcing", "sum", "sum, checks skipped"):
        model, task, sample, device = build_model_and_sample(cfg)
        criterion = (LabelSmoothedCrossEntropyCriterion(task, False, 0.1) if name == "teacher forcing" else
                     SoftBeamSearchCriterion(task, SoftBeamSearchConfig(
                         sentence_avg=False, label_smoothing=0.1, teacher_forcing_ratio=0.8,
                         soft_beam_candidates=50, soft_topk_scaling="paper", teacher_forcing_pass="search")))
        context = checks_skipped if name.endswith("skipped") else contextlib.nullcontext
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
