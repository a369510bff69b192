"""How often the soft beam search's bookkeeping continues the same candidate for several ranks (duplicate
beams), on one batch of a trained checkpoint, per ``--soft-topk-scaling`` and bookkeeping rule.

    .venv/bin/python benchmarks/soft_beam_duplicates.py work/demo/checkpoints/tf/checkpoint_last.pt work/demo/bin
"""
import argparse

import torch

import softtopk_fairseq.fairseq_plugin  # noqa: F401
import softtopk_fairseq.modules.soft_beam_search as search
from fairseq import checkpoint_utils


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("data")
    p.add_argument("--subset", default="valid")
    p.add_argument("--max-tokens", type=int, default=2000)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--epsilon", type=float, default=0.1)
    p.add_argument("--candidates", type=int, default=50)
    a = p.parse_args()
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([a.checkpoint], arg_overrides={"data": a.data})
    model = models[0].eval()
    task.load_dataset(a.subset)
    sample = next(task.get_batch_iterator(task.dataset(a.subset), max_tokens=a.max_tokens,
                                          required_batch_size_multiple=1).next_epoch_itr(shuffle=False))
    ni, d = sample["net_input"], task.target_dictionary
    print("| scaling | bookkeeping | sentence-steps with duplicate beams |\n|---|---|---|")
    for scaling in ("none", "paper"):
        for bookkeeping in ("argmax", "topk"):
            counts = [0, 0]
            original = search.soft_topk

            def counting(kept, k, **kw):  # count on the argmax of A (what "argmax" bookkeeping continues)
                A, info = original(kept, k, **kw)
                best = A.detach().argmax(1) if bookkeeping == "argmax" else torch.topk(kept.detach(), k, 1).indices
                counts[0] += sum(len(set(row.tolist())) < k for row in best)
                counts[1] += best.shape[0]
                return A, info

            search.soft_topk = counting
            try:
                with torch.no_grad():
                    search.soft_beam_search(model, ni["src_tokens"], ni["src_lengths"], sample["target"], pad=d.pad(),
                                            eos=d.eos(), beam=a.beam, epsilon=a.epsilon, scaling=scaling,
                                            candidates=a.candidates, bookkeeping=bookkeeping)
            finally:
                search.soft_topk = original
            print(f"| {scaling} | {bookkeeping} | {counts[0]} / {counts[1]} |", flush=True)


if __name__ == "__main__":
    main()
