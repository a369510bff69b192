"""How often the soft beam search's bookkeeping continues the same candidate for several ranks (duplicate
beams), on one batch of a trained checkpoint, per ``--soft-topk-scaling`` and bookkeeping rule.

    .venv/bin/python benchmarks/soft_beam_duplicates.py work/demo/checkpoints/tf/checkpoint_last.pt work/demo/bin
"""
import os
import sys

import torch

import softtopk_fairseq.modules.soft_beam_search as search
from softtopk_fairseq.ops import soft_topk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soft_beam_grad_norms import checkpoint_arguments, load_model_and_batch, soft_topk_replaced_by  # noqa: E402


def main():
    p = checkpoint_arguments(__doc__.splitlines()[0])
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--epsilon", type=float, default=0.1)
    a = p.parse_args()
    model, task, sample = load_model_and_batch(a)
    model.eval()
    ni, d = sample["net_input"], task.target_dictionary
    print("| scaling | bookkeeping | sentence-steps with duplicate beams |\n|---|---|---|")
    for scaling in ("none", "paper"):
        for bookkeeping in ("argmax", "topk"):
            counts = [0, 0]

            def counting(kept, k, **kw):  # count on the argmax of A (what "argmax" bookkeeping continues)
                A, info = soft_topk(kept, k, **kw)
                best = A.detach().argmax(1) if bookkeeping == "argmax" else torch.topk(kept.detach(), k, 1).indices
                counts[0] += sum(len(set(row.tolist())) < k for row in best)
                counts[1] += best.shape[0]
                return A, info

            with soft_topk_replaced_by(counting), torch.no_grad():
                search.soft_beam_search(model, ni["src_tokens"], ni["src_lengths"], sample["target"], pad=d.pad(),
                                        eos=d.eos(), beam=a.beam, epsilon=a.epsilon, scaling=scaling,
                                        candidates=a.candidates, bookkeeping=bookkeeping)
            print(f"| {scaling} | {bookkeeping} | {counts[0]} / {counts[1]} |", flush=True)


if __name__ == "__main__":
    main()
