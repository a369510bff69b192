"""Training-step time and peak memory of ``transformer_topk_attn`` against the same ``transformer``.

Same demo-size transformer (2+2 layers, d=128, 4 heads), same random Multi30k-sized batch as
``bench_soft_beam.py`` (128 sentences, source 14 / target 16 tokens, 8k vocabulary),
``label_smoothed_cross_entropy``; one update = forward + backward + Adam step; each configuration in its own
process; ratios within one run.

    .venv/bin/python benchmarks/bench_topk_attention.py                 # CPU, figures in docs/results.md
    .venv/bin/python benchmarks/bench_topk_attention.py --device cuda
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_soft_beam import (add_batch_arguments, batch_config, build_model_and_sample, time_updates,  # noqa: E402
                             warmup_updates)

VARIANTS = {
    "transformer (softmax)": dict(arch="transformer"),
    "transformer_topk_attn soft, enc-dec": dict(arch="transformer_topk_attn", topk_attn_mode="soft"),
    "transformer_topk_attn hard, enc-dec": dict(arch="transformer_topk_attn", topk_attn_mode="hard"),
    "transformer_topk_attn soft, all three": dict(arch="transformer_topk_attn", topk_attn_mode="soft",
                                                  topk_attn_layers="encoder-decoder,decoder-self,encoder-self"),
    "transformer_topk_attn perturbed (16 samples), enc-dec": dict(arch="transformer_topk_attn",
                                                                  topk_attn_mode="perturbed", topk_attn_samples=16),
}


def child(cfg):
    from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

    extra = dict(VARIANTS[cfg["variant"]], topk_attn_k=cfg["k"], topk_attn_epsilon=cfg["epsilon"])
    model, task, sample, device = build_model_and_sample(dict(cfg, arch="transformer"), extra)
    seconds, _, peak, _ = time_updates(model, LabelSmoothedCrossEntropyCriterion(task, False, 0.1), sample, device,
                                       cfg["repeats"], warmup_updates(cfg))
    print(json.dumps({"seconds": seconds, "peak_mib": peak}))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=4, help="--topk-attn-k")
    p.add_argument("--epsilon", type=float, default=0.1, help="--topk-attn-epsilon")
    add_batch_arguments(p, repeats=5)
    a = p.parse_args()
    if a.child:
        return child(json.loads(a.child))
    base = dict(batch_config(a), k=a.k, epsilon=a.epsilon)
    print(f"batch {a.bsz} x (src {a.src_len}, tgt {a.tgt_len}), vocab {a.vocab}, k {a.k}, epsilon {a.epsilon}, "
          f"{a.threads} threads, {a.device}, median of {a.repeats} updates")
    print("| model | s / update | x transformer | peak MiB | x transformer peak |\n|---|---|---|---|---|")

    def measure(name):
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(dict(base, variant=name))],
                             capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    # The baseline runs first and last; ratios are against the mean of the two (drift on a shared machine).
    names = list(VARIANTS)
    results = {name: measure(name) for name in names}
    again = measure(names[0])
    base_s = (results[names[0]]["seconds"] + again["seconds"]) / 2
    base_m = (results[names[0]]["peak_mib"] + again["peak_mib"]) / 2
    rows = [(n, results[n]) for n in names] + [(names[0] + ", again", again)]
    for name, r in rows:
        print(f"| {name} | {r['seconds']:.3f} | {r['seconds'] / base_s:.2f} | {r['peak_mib']:.0f} "
              f"| {r['peak_mib'] / base_m:.2f} |", flush=True)

if __name__ == "__main__":
    main()
