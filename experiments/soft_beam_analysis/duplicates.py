"""How often the soft beam search's bookkeeping continues the same candidate for several ranks (duplicate
beams), on one batch of a trained checkpoint, per ``--soft-beam-scaling`` and bookkeeping rule.

    .venv/bin/python experiments/soft_beam_analysis/duplicates.py work/demo/checkpoints/tf/checkpoint_last.pt \\
        work/demo/bin [--beam 5] [--epsilon 0.1] [--candidates 50]

Each decoding step's relaxed top-k is recorded (``checkpoint.RecordingSoftTopK``, the search's own SOFT top-k
passed to it as its relaxation), and a sentence-step counts as a duplicate when the candidates its k beams
continue are not all distinct: the argmax of each rank's column of A ("argmax" bookkeeping), the k best scores
("topk").
"""
import torch

from checkpoint import RecordingSoftTopK, checkpoint_arguments, load_model_and_batch, search


def duplicates(calls, k: int, bookkeeping: str):
    """(sentence-steps whose k continued candidates are not all distinct, sentence-steps) over recorded calls."""
    duplicated = total = 0
    for kept, A in calls:
        best = A.argmax(1) if bookkeeping == "argmax" else torch.topk(kept, k, 1).indices
        duplicated += sum(len(set(row.tolist())) < k for row in best)
        total += best.shape[0]
    return duplicated, total


def main():
    p = checkpoint_arguments(__doc__)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--epsilon", type=float, default=0.1)
    a = p.parse_args()
    model, task, sample = load_model_and_batch(a)
    model.eval()
    d = task.target_dictionary
    print("| scaling | bookkeeping | sentence-steps with duplicate beams |\n|---|---|---|")
    for scaling in ("none", "paper"):
        for bookkeeping in ("argmax", "topk"):
            relaxation = RecordingSoftTopK(a.beam, a.epsilon, scaling)
            with torch.no_grad():
                search(model, sample, d, beam=a.beam, relaxation=relaxation, candidates=a.candidates,
                       bookkeeping=bookkeeping)
            duplicated, total = duplicates(relaxation.calls, a.beam, bookkeeping)
            print(f"| {scaling} | {bookkeeping} | {duplicated} / {total} |", flush=True)


if __name__ == "__main__":
    main()
