"""Training-step time and peak memory of ``transformer_topk_attn`` against the same ``transformer``.

Same demo-size transformer (2+2 layers, d=128, 4 heads), same random Multi30k-sized batch as
``bench_soft_beam.py`` (128 sentences, source 14 / target 16 tokens, 8k vocabulary; ``training_step.py``),
``label_smoothed_cross_entropy``; one update = forward + backward + Adam step. Each variant runs in its own
process (its peak memory is its own, read after its warm-up); its ratio to the transformer is taken in that
process, against updates of the plain transformer timed alternately with its own (``harness.py``: rounds,
medians). The transformer's row runs in its own process too (its peak is the peak ratios' baseline).

    .venv/bin/python benchmarks/bench_topk_attention.py [--json PATH]     # CPU
    .venv/bin/python benchmarks/bench_topk_attention.py --device cuda
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from training_step import (ATTENTION_VARIANTS, add_batch_arguments, batch_config, build_model_and_sample,  # noqa: E402
                           teacher_forcing_criterion, time_updates, warmup_updates)

from softtopk_fairseq import defaults  # noqa: E402

BASELINE = next(iter(ATTENTION_VARIANTS))  # the transformer with softmax attention


def child(cfg):
    """One variant, in its own process: its median seconds per update, peak MiB and the seconds of the plain
    transformer's updates timed alternately with its own (not for the transformer's row), as one JSON line."""
    def build(variant):
        extra = dict(ATTENTION_VARIANTS[variant], topk_attn_k=cfg["k"], topk_attn_epsilon=cfg["epsilon"])
        model, task, sample, device = build_model_and_sample(dict(cfg, arch="transformer"), extra)
        return model, teacher_forcing_criterion(task), sample, device

    model, criterion, sample, device = build(cfg["variant"])
    seconds, _, peak, base_seconds = time_updates(
        model, criterion, sample, device, cfg["repeats"], warmup_updates(cfg),
        (lambda: build(BASELINE)[:2]) if cfg["variant"] != BASELINE else None)
    print(json.dumps({"seconds": seconds, "peak_mib": peak, "base_seconds": base_seconds}))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=defaults.TOPK_ATTN_K, help="--topk-attn-k")
    p.add_argument("--epsilon", type=float, default=defaults.EPSILON, help="--topk-attn-epsilon")
    add_batch_arguments(p, repeats=5)
    harness.add_json_argument(p)
    p.add_argument("--child", help=argparse.SUPPRESS)  # one variant, run by main() in its own process
    a = p.parse_args()
    if a.child:
        return child(json.loads(a.child))
    base = dict(batch_config(a), k=a.k, epsilon=a.epsilon)
    results = harness.Results("bench_topk_attention", a.json, device=a.device, threads=a.threads)
    print(f"batch {a.bsz} x (src {a.src_len}, tgt {a.tgt_len}), vocab {a.vocab}, k {a.k}, epsilon {a.epsilon}, "
          f"{a.threads} threads, {a.device}, median of {a.repeats} updates after "
          f"{warmup_updates(batch_config(a))} untimed; x transformer: against the transformer's updates timed "
          "alternately with the row's own in its process")
    print(harness.table_header(("model", "s / update", "x transformer", "peak MiB", "x transformer peak")))

    def measure(name):
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(dict(base, variant=name))],
                             capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    baseline = None
    for name, variant in ATTENTION_VARIANTS.items():
        r = measure(name)
        baseline = baseline or r
        config = dict(base, **variant)
        if name == BASELINE:
            results.add(name, r["seconds"], config=config, peak_mib=r["peak_mib"])
            ratio = 1.0
        else:
            results.add(name, r["seconds"], config=config, baseline=BASELINE, baseline_seconds=r["base_seconds"],
                        peak_mib=r["peak_mib"], peak_ratio=r["peak_mib"] / baseline["peak_mib"])
            ratio = r["seconds"] / r["base_seconds"]
        print(harness.table_row((name, f"{r['seconds']:.3f}", f"{ratio:.2f}", f"{r['peak_mib']:.0f}",
                                 f"{r['peak_mib'] / baseline['peak_mib']:.2f}")), flush=True)


if __name__ == "__main__":
    main()
