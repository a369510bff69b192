"""How far two soft top-k solvers that agree to the tolerance drift apart inside a soft beam search.

Runs ``soft_beam_search`` on one batch of a checkpoint twice, once with the C kernels (``backend="cpu"``) and
once with the PyTorch solver (``backend="torch"``), records the inputs and outputs of every step's soft top-k
(``checkpoint.RecordingSoftTopK``, passed to the search as its relaxation), and prints per decoding step: the
largest difference of the two runs' scores and soft top-k outputs, the difference of the two solvers on the
*same* scores, and how many beams' argmax bookkeeping differs.

    .venv/bin/python experiments/soft_beam_analysis/backend_drift.py \\
        work/multi30k/checkpoints/tf/checkpoint_last.pt work/multi30k/bin --max-tokens 1500 --epsilon 0.1 \\
        --scaling none
"""
import torch

from checkpoint import RecordingSoftTopK, checkpoint_arguments, load_model_and_batch, search


def run(model, sample, dictionary, backend, a):
    """The soft beam search with every soft top-k on ``backend``; returns its output and its recording
    relaxation (the (scores, A) of each step in ``calls``)."""
    relaxation = RecordingSoftTopK(a.beam, a.epsilon, a.scaling, backend=backend)
    with torch.no_grad():
        out = search(model, sample, dictionary, beam=a.beam, relaxation=relaxation, candidates=a.candidates)
    return out, relaxation


def main():
    p = checkpoint_arguments(__doc__)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--epsilon", type=float, default=0.1)
    p.add_argument("--scaling", default="none", choices=["none", "paper"], help="--soft-beam-scaling")
    a = p.parse_args()
    model, task, sample = load_model_and_batch(a)
    model.eval()
    d = task.target_dictionary
    out_c, rec_c = run(model, sample, d, "cpu", a)
    out_t, rec_t = run(model, sample, d, "torch", a)
    print(f"epsilon {a.epsilon:g} ({a.scaling}), beam {a.beam}, M {a.candidates}: same hypotheses: "
          f"{torch.equal(out_c.hypotheses, out_t.hypotheses)}; NLL sum C {float(out_c.nll.sum()):.3f}, "
          f"PyTorch {float(out_t.nll.sum()):.3f}")
    print("| step | max |scores C - scores PyTorch| | max |A C - A PyTorch| | same scores: max |A C - A PyTorch| "
          "| beams whose argmax differs |")
    print("|---|---|---|---|---|")
    for step, ((x_c, A_c), (x_t, A_t)) in enumerate(zip(rec_c.calls, rec_t.calls)):
        both = torch.isfinite(x_c) & torch.isfinite(x_t)
        dx = float((x_c - x_t)[both].abs().max()) if bool(both.any()) else 0.0
        same = (rec_t.solve(x_t, "cpu") - rec_t.solve(x_t, "torch")).abs().max()
        flips = int((A_c.argmax(1) != A_t.argmax(1)).sum())
        print(f"| {step} | {dx:.2e} | {float((A_c - A_t).abs().max()):.2e} | {float(same):.2e} | {flips} |")


if __name__ == "__main__":
    main()
