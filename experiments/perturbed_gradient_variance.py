"""How noisy is the perturbed top-k's gradient? The spread of its Monte-Carlo estimate across seeds, relative to
its mean, at the operator benchmark's shapes and through the soft beam-search criterion.

    .venv/bin/python experiments/perturbed_gradient_variance.py [--seeds 20] [--samples 10 100]

Figures, from ``--seeds`` independent noise draws: ``||std over seeds||_2 / ||g||_2`` (elementwise std, norms over
all elements; ``||g||^2`` estimated without bias as ``||mean||^2 - ||std||^2 / seeds``, since the mean over seeds
is itself noisy) -- 1.0 means one estimate's noise is as large as the gradient -- and the mean cosine similarity
between two seeds' estimates (1 = the same direction). SOFT top-k and softmax-k-times are deterministic (0 and 1).
The estimator puts noise on *every* coordinate (``<G, y> Z / sigma``), including those far from the top-k whose
true derivative is ~0, so the relative noise grows with ``n``. Operator rows: ``perturbed_topk`` at the
operator benchmark's shapes (``benchmarks/harness.py``; k = 5, sigma = 0.1 on the paper-normalised scale of the scores, i.e. the
scores divided by each row's ``effective_epsilon / epsilon``), loss = a fixed random linear function of the
output, with and without the control variate. Criterion rows: the gradient of L_SOFT (rho 0) with respect to
all parameters of the benchmarks' demo LSTM (``benchmarks/training_step.py``) on a small batch,
``--soft-beam-relaxation perturbed`` (paper scaling, sigma ``--soft-beam-epsilon`` 0.1, M = 50).
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import OPERATOR_K as K, OPERATOR_SHAPES as SHAPES, operator_scores  # noqa: E402

from softtopk_fairseq.ops import effective_epsilon, perturbed_topk  # noqa: E402

SIGMA = 0.1


def spread(grads):
    """(||std|| / ||g||, mean cosine between two seeds' estimates). ``||g||^2`` is estimated without bias as
    ``||mean||^2 - ||std||^2 / seeds`` (the mean over seeds still carries noise); nan when that is <= 0."""
    g = torch.stack([x.flatten().double() for x in grads])
    n = g.shape[0]
    noise = float(g.std(0).norm())
    signal_sq = float(g.mean(0).norm()) ** 2 - noise ** 2 / n
    unit = torch.nn.functional.normalize(g, dim=1)
    cosines = unit @ unit.T
    mean_cos = float((cosines.sum() - n) / (n * (n - 1)))
    return (noise / signal_sq ** 0.5 if signal_sq > 0 else float("nan")), mean_cos


def operator_rows(shapes, samples_list, seeds, sorted_output):
    gen = torch.Generator().manual_seed(0)
    for name in shapes:
        rows, n = SHAPES[name]
        x = operator_scores(name, rows, n, gen)
        # sigma on the paper's per-row normalised scale, as the criterion and the benchmark's epsilon use it
        scale = effective_epsilon(x, K, epsilon=1.0, sorted=sorted_output, scaling="paper").unsqueeze(-1)
        w = torch.randn(*x.shape, *((K,) if sorted_output else ()), generator=gen)
        for samples in samples_list:
            for cv in (True, False):
                grads = []
                for seed in range(seeds):
                    xg = x.clone().requires_grad_()
                    out = perturbed_topk(xg / scale, K, sigma=SIGMA, samples=samples, sorted=sorted_output,
                                         generator=torch.Generator().manual_seed(seed), control_variate=cv)
                    (out * w).sum().backward()
                    grads.append(xg.grad)
                yield (f"perturbed_topk {'sorted' if sorted_output else 'unsorted'}", f"{name} {rows}x{n}",
                       samples, "yes" if cv else "no", *spread(grads))


def criterion_rows(samples_list, seeds):
    from training_step import build_model_and_sample, soft_beam_criterion

    cfg = dict(arch="lstm", threads=torch.get_num_threads(), device="cpu", bsz=16, src_len=14, tgt_len=16,
               vocab=8000)
    model, task, sample, _ = build_model_and_sample(cfg)
    model.eval()  # no dropout: the perturbation is the only noise
    for samples in samples_list:
        criterion = soft_beam_criterion(task, teacher_forcing_ratio=0.0, soft_beam_size=5, soft_beam_candidates=50,
                                        soft_beam_relaxation="perturbed", soft_beam_epsilon=SIGMA,
                                        soft_beam_samples=samples)
        grads = []
        for seed in range(seeds):
            torch.manual_seed(seed)
            model.zero_grad()
            criterion(model, sample)[0].backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        yield ("soft_beam_search L_SOFT (demo LSTM, bsz 16, beam 5, M 50)", "all parameters", samples, "yes",
               *spread(grads))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--samples", nargs="+", type=int, default=[10, 100])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--no-criterion", action="store_true", help="operator rows only")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"spread of the gradient estimate over {a.seeds} seeds; k {K}, sigma {SIGMA} "
          "(paper-normalised)")
    print("| what | shape | samples | control variate | ||std|| / ||g|| | cosine between two seeds |")
    print("|---|---|---|---|---|---|")
    rows = [operator_rows(a.shapes, a.samples, a.seeds, False), operator_rows(a.shapes, a.samples, a.seeds, True)]
    if not a.no_criterion:
        rows.append(criterion_rows(a.samples, a.seeds))
    for group in rows:
        for what, shape, samples, cv, relative, cosine in group:
            print(f"| {what} | {shape} | {samples} | {cv} | {relative:.2f} | {cosine:.3f} |", flush=True)


if __name__ == "__main__":
    main()
