"""Loss and gradient norm per token of teacher forcing and of ``L_SOFT`` alone, on one batch of a trained
checkpoint, for several relaxation settings (how soft is the soft beam search on a trained model?).

    .venv/bin/python experiments/soft_beam_analysis/grad_norms.py work/demo/checkpoints/tf/checkpoint_last.pt \\
        work/demo/bin [--eval-mode] [--candidates 50]
"""
import torch
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

from checkpoint import checkpoint_arguments, load_model_and_batch
from softtopk_fairseq.criterions.soft_beam_search import SoftBeamSearchConfig, SoftBeamSearchCriterion

NATS = dict(soft_beam_scaling="none")  # epsilon in nats of log-likelihood
PAPER = dict(soft_beam_scaling="paper")
SOFTMAX_K_TIMES = dict(soft_beam_relaxation="softmax_k_times")
# The criterion's settings (SoftBeamSearchConfig fields), one row each.
SETTINGS = [dict(NATS, soft_beam_epsilon=0.01), dict(NATS, soft_beam_epsilon=0.1), dict(NATS, soft_beam_epsilon=1.0),
            dict(NATS, soft_beam_epsilon=10.0), dict(PAPER, soft_beam_epsilon=0.1),
            dict(NATS, soft_beam_epsilon=0.1, **SOFTMAX_K_TIMES), dict(PAPER, soft_beam_epsilon=0.1, **SOFTMAX_K_TIMES)]


def main():
    p = checkpoint_arguments(__doc__)
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
