"""How far two soft top-k solvers that agree to the tolerance drift apart inside a soft beam search.

Runs ``soft_beam_search`` on one batch of a checkpoint twice, once with the C kernels (``backend="cpu"``) and
once with the PyTorch solver (``backend="torch"``), records the inputs and outputs of every ``soft_topk`` call,
and prints per decoding step: the largest difference of the two runs' scores and soft top-k outputs, the
difference of the two solvers on the *same* scores, and how many beams' argmax bookkeeping differs.

    .venv/bin/python benchmarks/soft_beam_backend_drift.py work/multi30k/checkpoints/tf/checkpoint_last.pt \\
        work/multi30k/bin --max-tokens 1500 --epsilon 0.1 --scaling none
"""
import torch

import softtopk_fairseq.modules.soft_beam_search as beam_module
from softtopk_fairseq.ops import soft_topk
from soft_beam_grad_norms import checkpoint_arguments, load_model_and_batch, soft_topk_replaced_by


def run(model, sample, dictionary, backend, a):
    """The soft beam search with every soft top-k on ``backend``; returns its output and the (scores, A) per step."""
    calls = []

    def recording_soft_topk(scores, k, return_info=False, **kw):
        A, info = soft_topk(scores, k, backend=backend, return_info=True, **kw)
        calls.append((scores.detach().clone(), A.detach().clone(), kw))
        return (A, info) if return_info else A

    ni = sample["net_input"]
    with soft_topk_replaced_by(recording_soft_topk), torch.no_grad():
        out = beam_module.soft_beam_search(
            model, ni["src_tokens"], ni["src_lengths"], sample["target"], pad=dictionary.pad(),
            eos=dictionary.eos(), beam=a.beam, epsilon=a.epsilon, scaling=a.scaling, candidates=a.candidates)
    return out, calls


def main():
    p = checkpoint_arguments(__doc__.splitlines()[0])
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--epsilon", type=float, default=0.1)
    p.add_argument("--scaling", default="none", choices=["none", "paper"])
    a = p.parse_args()
    model, task, sample = load_model_and_batch(a)
    model.eval()
    d = task.target_dictionary
    out_c, calls_c = run(model, sample, d, "cpu", a)
    out_t, calls_t = run(model, sample, d, "torch", a)
    print(f"epsilon {a.epsilon:g} ({a.scaling}), beam {a.beam}, M {a.candidates}: same hypotheses: "
          f"{torch.equal(out_c.hypotheses, out_t.hypotheses)}; NLL sum C {float(out_c.nll.sum()):.3f}, "
          f"PyTorch {float(out_t.nll.sum()):.3f}")
    print("| step | max |scores C - scores PyTorch| | max |A C - A PyTorch| | same scores: max |A C - A PyTorch| "
          "| beams whose argmax differs |")
    print("|---|---|---|---|---|")
    for step, ((x_c, A_c, kw), (x_t, A_t, _)) in enumerate(zip(calls_c, calls_t)):
        both = torch.isfinite(x_c) & torch.isfinite(x_t)
        dx = float((x_c - x_t)[both].abs().max()) if bool(both.any()) else 0.0
        same = (soft_topk(x_t, a.beam, backend="cpu", **kw) - soft_topk(x_t, a.beam, backend="torch", **kw)).abs().max()
        flips = int((A_c.argmax(1) != A_t.argmax(1)).sum())
        print(f"| {step} | {dx:.2e} | {float((A_c - A_t).abs().max()):.2e} | {float(same):.2e} | {flips} |")


if __name__ == "__main__":
    main()
