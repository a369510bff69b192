"""Does pruning train the same thing as the exact soft beam search? On batches of a trained checkpoint, for
each setting and each number of kept candidates M (0 = exact: all k*V), L_SOFT, the cosine similarity of the
model's gradient to the exact gradient, the pruned-mass bound and the duplicate-beam rate.

    .venv/bin/python experiments/soft_beam_analysis/pruning.py CHECKPOINT DATA_BIN [--candidates 50 200 0] \\
        [--batches 2]

Settings: ``paper`` (rho 0 -- L_SOFT alone, so the gradient is the search's own --, beam 5, eps 0.1, paper
scaling, argmax bookkeeping) and ``topk_nats`` (topk bookkeeping, eps 1 nat, no scaling) -- change them with
``--settings``. The same batches and the same dropout draw (eval mode: no dropout) for every M. ``--json``
writes the rows for the converged study's ledger (``experiments/multi30k_converged/driver.py``).
"""
import json

import torch

from checkpoint import batches, checkpoint_arguments, load_model_and_task, search

SETTINGS = {
    "paper": dict(epsilon=0.1, scaling="paper", bookkeeping="argmax"),
    "topk_nats": dict(epsilon=1.0, scaling="none", bookkeeping="topk"),
}


def duplicate_rate(hypotheses: torch.Tensor) -> float:
    """Share of sentences whose k final beams are not all distinct."""
    return sum(len({tuple(h) for h in sent.tolist()}) < sent.shape[0] for sent in hypotheses) / len(hypotheses)


def measure(model, samples, d, beam, candidates, options):
    """L_SOFT per token, the flattened gradient, the pruned-mass bound per sentence-step and the duplicate rate,
    summed over ``samples``."""
    model.zero_grad()
    loss = tokens = pruned = steps = dup = 0.0
    for sample in samples:
        out = search(model, sample, d, beam=beam, candidates=candidates, **options)
        total = out.nll.sum()
        total.backward()
        loss += total.item()
        tokens += int(sample["ntokens"])
        pruned += float(out.pruned_mass.sum())
        steps += out.nll.numel() * max(sample["target"].shape[1] - 1, 1)
        dup += duplicate_rate(out.hypotheses) * out.nll.numel()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double()
    sentences = sum(s["target"].shape[0] for s in samples)
    return loss / tokens, grad, pruned / steps, dup / sentences


def main():
    p = checkpoint_arguments(__doc__, max_tokens=1000, candidates=False)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--candidates", type=int, nargs="+", default=[50, 200, 0], help="M values (0 = exact)")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--json", help="also write the rows here (JSON lines)")
    a = p.parse_args()
    model, task = load_model_and_task(a)
    model.eval()  # no dropout: M is the only difference between the runs
    samples = batches(task, a, a.batches)
    d = task.target_dictionary
    print(f"{sum(s['target'].shape[0] for s in samples)} sentences of {a.subset}, beam {a.beam}, "
          f"vocabulary {len(d)} (exact = all {a.beam * len(d)} candidates)")
    print("| setting | M | L_SOFT (nats/token) | gradient cosine to exact | gradient norm / exact | "
          "pruned-mass bound / step | duplicate beams |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name in a.settings:
        exact = measure(model, samples, d, a.beam, 0, SETTINGS[name])
        for m in a.candidates:
            loss, grad, pruned, dup = exact if m == 0 else measure(model, samples, d, a.beam, m, SETTINGS[name])
            cos = float(torch.nn.functional.cosine_similarity(grad, exact[1], dim=0))
            ratio = float(grad.norm() / exact[1].norm())
            row = dict(setting=name, candidates=m, soft_loss=loss, grad_cosine=cos, grad_norm_ratio=ratio,
                       pruned_mass=pruned, duplicate_rate=dup)
            rows.append(row)
            print(f"| {name} | {'exact' if m == 0 else m} | {loss:.4f} | {cos:.6f} | {ratio:.4f} | {pruned:.3g} | "
                  f"{dup:.2f} |", flush=True)
    if a.json:
        with open(a.json, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(dict(row, checkpoint=a.checkpoint)) + "\n")


if __name__ == "__main__":
    main()
