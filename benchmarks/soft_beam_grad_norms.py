"""Loss and gradient norm per token of teacher forcing and of ``L_SOFT`` alone, on one batch of a trained
checkpoint, for several relaxation settings (how soft is the soft beam search on a trained model?).

    .venv/bin/python benchmarks/soft_beam_grad_norms.py work/demo/checkpoints/tf/checkpoint_last.pt work/demo/bin
"""
import argparse
import contextlib

import torch

import softtopk_fairseq.fairseq_plugin  # noqa: F401
from fairseq import checkpoint_utils
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
import softtopk_fairseq.modules.soft_beam_search as search
from softtopk_fairseq.criterions.soft_beam_search import SoftBeamSearchConfig, SoftBeamSearchCriterion

NATS = dict(soft_topk_scaling="none")  # epsilon in nats of log-likelihood
SETTINGS = [dict(NATS, soft_topk_epsilon=0.01), dict(NATS, soft_topk_epsilon=0.1), dict(NATS, soft_topk_epsilon=1.0),
            dict(NATS, soft_topk_epsilon=10.0), dict(soft_topk_epsilon=0.1, soft_topk_scaling="paper"),
            dict(NATS, soft_topk_epsilon=0.1, soft_topk_method="softmax_k_times"),
            dict(soft_topk_epsilon=0.1, soft_topk_scaling="paper", soft_topk_method="softmax_k_times")]


def checkpoint_arguments(description):
    """Parser with the checkpoint / data / batch options shared by the checkpoint-based soft beam scripts."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("checkpoint")
    p.add_argument("data")
    p.add_argument("--subset", default="valid")
    p.add_argument("--max-tokens", type=int, default=2000)
    p.add_argument("--candidates", type=int, default=50)
    return p


def load_model_and_batch(a):
    """The checkpoint's model (in train mode), its task, and the first batch of ``--subset``."""
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([a.checkpoint], arg_overrides={"data": a.data})
    task.load_dataset(a.subset)
    sample = next(task.get_batch_iterator(task.dataset(a.subset), max_tokens=a.max_tokens,
                                          required_batch_size_multiple=1).next_epoch_itr(shuffle=False))
    return models[0], task, sample


@contextlib.contextmanager
def soft_topk_replaced_by(fn):
    """``soft_beam_search`` calls ``fn`` instead of ``soft_topk`` inside the block (to record or count its calls)."""
    original = search.soft_topk
    search.soft_topk = fn
    try:
        yield
    finally:
        search.soft_topk = original


def main():
    p = checkpoint_arguments(__doc__.splitlines()[0])
    p.add_argument("--eval-mode", action="store_true", help="no dropout (default: train mode, as in training)")
    a = p.parse_args()
    torch.manual_seed(0)
    model, task, sample = load_model_and_batch(a)
    model = model.eval() if a.eval_mode else model.train()

    def measure(criterion):
        model.zero_grad()
        loss, size, _ = criterion(model, sample)
        (loss / size).backward()
        norm = torch.sqrt(sum((q.grad ** 2).sum() for q in model.parameters() if q.grad is not None))
        return float(loss) / size, float(norm)

    print("| criterion | loss / token (nats) | gradient norm |\n|---|---|---|")
    loss, norm = measure(LabelSmoothedCrossEntropyCriterion(task, False, 0.1))
    print(f"| label_smoothed_cross_entropy | {loss:.3f} | {norm:.3f} |")
    for setting in SETTINGS:
        loss, norm = measure(SoftBeamSearchCriterion(task, SoftBeamSearchConfig(
            sentence_avg=False, label_smoothing=0.1, teacher_forcing_ratio=0.0, soft_beam_candidates=a.candidates,
            **setting)))
        print(f"| soft_beam_search rho 0, {setting} | {loss:.3f} | {norm:.3f} |")


if __name__ == "__main__":
    main()
