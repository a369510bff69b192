"""What ``--soft-beam-cuda-graphs`` costs and saves over batches of varying shapes, as fairseq's batching gives
them: the graphs are captured once per batch size (the first time each comes), then replayed.

One model per update kind (same seed), a sequence of ``--batches`` random batches -- sentences drawn from
``--bsz-choices`` (fairseq rounds batch sizes to ``--required-batch-size-multiple``, 8), source and target lengths
from ``--src-lens`` / ``--tgt-lens`` -- run ``--epochs`` times in the same order, each update (forward, backward,
Adam step) timed, the kinds alternating batch by batch: teacher forcing, the ``sum`` update (rho 0.8, M 50, paper
scaling, teacher forcing in the search), and the same with the CUDA graphs. Prints per epoch the total seconds of
each kind and the ratios to teacher forcing: the first epoch pays every capture, the later ones none.

    python scripts/gpu/soft_beam_graph_batches.py --device cuda --threads 8 [--batches 40] [--epochs 2]

Off CUDA the graphs are not used (the third kind is the second again).
"""
import argparse
import os
import random
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import harness  # noqa: E402
from training_step import (TEACHER_FORCING, Update, adam, build_model_and_sample, random_sample,  # noqa: E402
                           update_criterion)

KINDS = (TEACHER_FORCING, "sum", "sum, CUDA graphs")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--bsz-choices", type=int, nargs="+", default=[64, 72, 80, 88, 96, 104, 112, 120, 128])
    p.add_argument("--src-lens", type=int, nargs=2, default=[8, 24], help="source lengths, from and to")
    p.add_argument("--tgt-lens", type=int, nargs=2, default=[8, 24], help="target lengths, from and to")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    import torch

    cfg = dict(arch="lstm", bsz=a.bsz_choices[0], src_len=a.src_lens[0], tgt_len=a.tgt_lens[0], vocab=a.vocab,
               threads=a.threads, device=a.device)
    updates = {}
    for kind in KINDS:
        model, task, _, device = build_model_and_sample(cfg)
        updates[kind] = (model, update_criterion(kind, task))
    d = task.target_dictionary
    rng = random.Random(0)
    shapes = [(rng.choice(a.bsz_choices), rng.randint(*a.src_lens), rng.randint(*a.tgt_lens))
              for _ in range(a.batches)]
    torch.manual_seed(0)
    batches = [random_sample(d, bsz, S, T, device) for bsz, S, T in shapes]
    # One update per kind and batch, each kind with its own Adam across the batches.
    optimizers = {kind: adam(model) for kind, (model, _) in updates.items()}
    steps = {kind: [Update(model, criterion, sample, device, optimizers[kind]) for sample in batches]
             for kind, (model, criterion) in updates.items()}
    # One untimed update per kind first (the first batch): allocators, cuDNN, Triton's compiles are not the graphs'.
    harness.warm_up({kind: step[0] for kind, step in steps.items()})
    graphed = updates[KINDS[2]][1].graphs
    graphed.pairs.clear()
    print(f"lstm, {a.batches} batches of {min(a.bsz_choices)}-{max(a.bsz_choices)} sentences "
          f"({len(set(s[0] for s in shapes))} sizes), source {a.src_lens[0]}-{a.src_lens[1]}, target "
          f"{a.tgt_lens[0]}-{a.tgt_lens[1]} tokens, vocab {a.vocab}, beam 5, M 50, {device}, {a.threads} threads")
    print("| epoch | " + " | ".join(f"{k} s" for k in KINDS) + " | sum x TF | graphs x TF | captures |\n"
          "|---|---|---|---|---|---|---|")
    for epoch in range(a.epochs):
        seconds = dict.fromkeys(KINDS, 0.0)
        before = graphed.captures
        for i in range(len(batches)):  # the kinds alternating batch by batch
            for kind, step in steps.items():
                seconds[kind] += harness.seconds(step[i], device)
        tf = seconds[KINDS[0]]
        print(f"| {epoch + 1} | " + " | ".join(f"{seconds[k]:.2f}" for k in KINDS) +
              f" | {seconds[KINDS[1]] / tf:.2f} | {seconds[KINDS[2]] / tf:.2f} | {graphed.captures - before} |")


if __name__ == "__main__":
    main()
