"""Time per update and peak memory of ``soft_beam_search`` against ``label_smoothed_cross_entropy``.

Same model, same batch (Multi30k-sized by default: 128 sentences, source 14 / target 16 tokens, an 8k joint
vocabulary as in a sentencepiece run), the pipeline's demo-size LSTM and transformer, and RNNsearch
(``training_step.py``). One update = criterion forward + backward + Adam step. Each configuration runs in its own
process, so the peak memory it reports (CPU: the process's ``ru_maxrss``; GPU: ``max_memory_allocated``) is that
configuration's own, read after its warm-up; its ratio to teacher forcing is taken in that process, against
teacher-forcing updates of the same model timed alternately with its own (``harness.py``: rounds, medians). The
teacher-forcing row runs in its own process too (its peak is the peak ratios' baseline).

    .venv/bin/python benchmarks/bench_soft_beam.py [--json PATH]     # CPU
    .venv/bin/python benchmarks/bench_soft_beam.py --device cuda     # on a GPU
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from training_step import (ARCHS, add_batch_arguments, batch_config, build_model_and_sample,  # noqa: E402
                           soft_beam_criterion, teacher_forcing_criterion, time_updates, warmup_updates)

from softtopk_fairseq import defaults  # noqa: E402
from softtopk_fairseq.modules import relaxations  # noqa: E402

TF_ROW = "label_smoothed_cross_entropy"  # the teacher-forcing row, and the baseline of the others
COLUMNS = ("arch", "criterion", "relaxation", "candidates M", "s / update", "x teacher forcing", "peak MiB",
           "x TF peak", "pruned-mass bound / step", "solver iters")


def child(cfg):
    """One configuration, in its own process: its median seconds per update, peak MiB, the seconds of
    teacher-forcing updates timed alternately with its own (not for the teacher-forcing row) and its logged
    search figures, as one JSON line on stdout."""
    model, task, sample, device = build_model_and_sample(cfg)
    if cfg["criterion"] == "tf":
        criterion = teacher_forcing_criterion(task)
    else:
        criterion = soft_beam_criterion(
            task, teacher_forcing_ratio=cfg["rho"], soft_beam_size=cfg["beam"], soft_beam_candidates=cfg["candidates"],
            soft_beam_relaxation=cfg["relaxation"], soft_beam_scaling=cfg["scaling"], soft_beam_samples=cfg["samples"],
            teacher_forcing_pass=cfg["tf_pass"])

    def teacher_forcing():  # the baseline: the same model built again (same seed), teacher forcing's criterion
        tf_model, tf_task, _, _ = build_model_and_sample(cfg)
        return tf_model, teacher_forcing_criterion(tf_task)

    seconds, log, peak, tf_seconds = time_updates(model, criterion, sample, device, cfg["repeats"],
                                                  warmup_updates(cfg),
                                                  teacher_forcing if cfg["criterion"] != "tf" else None)
    print(json.dumps({"seconds": seconds, "peak_mib": peak, "tf_seconds": tf_seconds,
                      "pruned_mass": float(log.get("pruned_mass", 0)) / max(log.get("soft_sentence_steps", 1), 1),
                      "iters": float(log.get("soft_topk_iters", 0)) / max(log.get("soft_topk_steps", 1), 1)}))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", nargs="+", default=["lstm", "transformer"], choices=list(ARCHS))
    p.add_argument("--candidates", nargs="+", type=int, default=[500, 50],
                   help="--soft-beam-candidates values to run (0 = all k*V, exact)")
    p.add_argument("--beam", type=int, default=defaults.BEAM, help="--soft-beam-size")
    p.add_argument("--rho", type=float, default=defaults.TEACHER_FORCING_RATIO, help="--teacher-forcing-ratio")
    p.add_argument("--relaxations", "--methods", nargs="+", default=[defaults.SEARCH_RELAXATION],
                   choices=list(relaxations.names("search")),
                   help="--soft-beam-relaxation values to run (each at the criterion's default --soft-beam-epsilon; "
                        "--methods: the old name of this option)")
    p.add_argument("--samples", "--perturbed-samples", type=int, default=defaults.PERTURBED_SAMPLES,
                   help="--soft-beam-samples (--perturbed-samples: the old name of this option)")
    p.add_argument("--scaling", default=defaults.SEARCH_SCALING, choices=["paper", "none"], help="--soft-beam-scaling")
    p.add_argument("--teacher-forcing-passes", nargs="+", default=["search", "separate"],
                   choices=["search", "separate"], help="--teacher-forcing-pass values of the sum-mode rows")
    add_batch_arguments(p, repeats=3)
    harness.add_json_argument(p)
    p.add_argument("--child", help=argparse.SUPPRESS)  # one configuration, run by main() in its own process
    a = p.parse_args()
    if a.child:
        return child(json.loads(a.child))
    base = dict(batch_config(a), beam=a.beam, rho=a.rho, scaling=a.scaling, samples=a.samples,
                tf_pass=a.teacher_forcing_passes[0])
    results = harness.Results("bench_soft_beam", a.json, device=a.device, threads=a.threads)

    def measure(**cfg):
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps({**base, **cfg})],
                             capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    print(f"batch {a.bsz} x (src {a.src_len}, tgt {a.tgt_len}), vocab {a.vocab}, beam {a.beam}, rho {a.rho}, "
          f"scaling {a.scaling}, perturbed samples {a.samples}, {a.threads} threads, {a.device}, "
          f"median of {a.repeats} updates after {warmup_updates(batch_config(a))} untimed")
    print("x teacher forcing: against teacher-forcing updates of the same model, timed alternately with the row's "
          "own in its process (the teacher-forcing row: its own process)")
    print(harness.table_header(COLUMNS))
    for arch in a.archs:
        tf = measure(arch=arch, criterion="tf", candidates=0, relaxation=defaults.SEARCH_RELAXATION)
        tf_config = dict(base, arch=arch, criterion=TF_ROW)
        results.add(TF_ROW, tf["seconds"], config=tf_config, peak_mib=tf["peak_mib"])
        print(harness.table_row((arch, TF_ROW, "-", "-", f"{tf['seconds']:.3f}", "1.00",
                                 f"{tf['peak_mib']:.0f}", "1.00", "-", "-")), flush=True)
        for relaxation, m in ((relaxation, m) for relaxation in a.relaxations for m in a.candidates):
            label = "all (exact)" if m <= 0 else str(m)
            rows = [(f"soft_beam_search, rho {a.rho}, sum, teacher forcing {tf_pass}",
                     dict(tf_pass=tf_pass, mode="sum"),
                     measure(arch=arch, criterion="soft", candidates=m, relaxation=relaxation, tf_pass=tf_pass))
                    for tf_pass in a.teacher_forcing_passes]
            if 0 < a.rho < 1:
                only = measure(arch=arch, criterion="soft", candidates=m, rho=0.0, relaxation=relaxation)
                rows.append(("soft_beam_search, rho 0 (L_SOFT only)", dict(rho=0.0, mode="sum"), only))
                # --teacher-forcing-mode sample: one of the two losses per batch, so its expected update time
                # is the rho-weighted mean of the two measured times.
                rows.append((f"soft_beam_search, rho {a.rho}, sample (expected: rho t_TF + (1-rho) t_SOFT)",
                             dict(mode="sample", expected=True),
                             dict(only, seconds=a.rho * only["tf_seconds"] + (1 - a.rho) * only["seconds"],
                                  peak_mib=max(tf["peak_mib"], only["peak_mib"]))))
            for name, config, r in rows:
                results.add(name, r["seconds"], config=dict(base, arch=arch, criterion="soft_beam_search",
                                                            relaxation=relaxation, candidates=m, **config),
                            baseline=TF_ROW, baseline_seconds=r["tf_seconds"], peak_mib=r["peak_mib"],
                            peak_ratio=r["peak_mib"] / tf["peak_mib"], pruned_mass=r["pruned_mass"],
                            solver_iters=r["iters"])
                print(harness.table_row((arch, name, relaxation, label, f"{r['seconds']:.3f}",
                                         f"{r['seconds'] / r['tf_seconds']:.2f}", f"{r['peak_mib']:.0f}",
                                         f"{r['peak_mib'] / tf['peak_mib']:.2f}", f"{r['pruned_mass']:.2e}",
                                         f"{r['iters']:.1f}")), flush=True)


if __name__ == "__main__":
    main()
