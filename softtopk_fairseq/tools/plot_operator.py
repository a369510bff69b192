"""The operator's pictures, redrawn with :func:`softtopk_fairseq.ops.soft_topk` (paper, Figures 3 and 7).

    python -m softtopk_fairseq.tools.plot_operator --out docs/figures

* ``fig3_soft_topk_vs_epsilon.png`` -- 50 standard Gaussian scores, k = 5, one column per epsilon: above,
  the sorted SOFT top-k output A[i, l] (rows: the scores in decreasing order; columns: ranks 1..k and the
  rest, i.e. n times the transport plan to the k+1 anchors); below, the unsorted output A_i against x_i.
* ``fig7_gradient_field.png`` -- scores x = 0, 1, ..., 9, k = 3, objective f = sum_{i in I} A_i (the kNN
  loss of Sec. 4.1): the arrows are the gradient df/dx_i (ascent), (a) I = the top-3 indices, (b) I = other
  indices. Top row: temperature in score units (``--fig7-epsilon``); bottom row: the authors' normalisation
  at 0.1, whose temperature grows with the cost range, so raising the largest score smooths the output and
  its gradient in (a) points down.

``--scaling``/``--epsilons`` choose Figure 3's temperatures (default: the authors' normalisation).
"""
import argparse
import os
from typing import Dict, List, Sequence

import torch

from softtopk_fairseq.ops import soft_topk


def figure3_data(epsilons: Sequence[float], scaling: str, n: int = 50, k: int = 5, seed: int = 0) -> Dict:
    """Scores (sorted decreasingly) and, per epsilon, the sorted output with a 'rest' column and the unsorted one."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).sort(descending=True).values
    out = {"x": x, "k": k, "sorted": {}, "unsorted": {}}
    for eps in epsilons:
        ranks = soft_topk(x, k, epsilon=eps, sorted=True, scaling=scaling)
        out["sorted"][eps] = torch.cat([ranks, (1 - ranks.sum(-1, keepdim=True)).clamp_min(0)], dim=-1)
        out["unsorted"][eps] = soft_topk(x, k, epsilon=eps, scaling=scaling)
    return out


FIG7_INDEX_SETS = ([7, 8, 9], [1, 4, 8])  # (a) the top-3 indices, (b) others


def figure7_data(index_sets: Sequence[Sequence[int]], epsilon: float, scaling: str, k: int = 3) -> Dict:
    """Gradient of f = sum_{i in I} A_i at x = 0..9 for each index set I."""
    grads = []
    for index in index_sets:
        x = torch.arange(10, dtype=torch.float64, requires_grad=True)
        soft_topk(x, k, epsilon=epsilon, scaling=scaling)[list(index)].sum().backward()
        grads.append(x.grad.clone())
    return {"x": torch.arange(10.0), "k": k, "index_sets": [list(i) for i in index_sets], "grads": grads}


def draw(out_dir: str, epsilons: List[float], fig7_epsilon: float, scaling: str) -> Dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    d3 = figure3_data(epsilons, scaling)
    fig, axes = plt.subplots(2, len(epsilons), figsize=(3.2 * len(epsilons), 6), squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1]})
    for col, eps in enumerate(epsilons):
        top, bottom = axes[0, col], axes[1, col]
        top.imshow(d3["sorted"][eps].numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        top.set_xticks(range(d3["k"] + 1), [str(i + 1) for i in range(d3["k"])] + ["rest"])
        top.set_title(f"epsilon = {eps:g}")
        top.set_xlabel("rank")
        top.set_ylabel("scores, largest first" if col == 0 else "")
        bottom.scatter(d3["x"].numpy(), d3["unsorted"][eps].numpy(), s=10)
        bottom.set_xlabel("score x_i")
        bottom.set_ylabel("A_i (unsorted)" if col == 0 else "")
        bottom.set_ylim(-0.05, 1.05)
    fig.suptitle(f"SOFT top-k of 50 Gaussian scores, k = {d3['k']} ({scaling} scaling)")
    fig.tight_layout()
    paths["fig3"] = os.path.join(out_dir, "fig3_soft_topk_vs_epsilon.png")
    fig.savefig(paths["fig3"], dpi=110)
    plt.close(fig)

    settings = [("none", fig7_epsilon), ("paper", 0.1)]
    fig, axes = plt.subplots(len(settings), 2, figsize=(9, 2.6 * len(settings)), sharey=True, squeeze=False)
    for row, (row_scaling, eps) in enumerate(settings):
        d7 = figure7_data(FIG7_INDEX_SETS, eps, row_scaling)
        for ax, index, grad, name in zip(axes[row], d7["index_sets"], d7["grads"], "ab"):
            scale = float(grad.abs().max()) or 1.0
            colors = ["C1" if i in index else "C0" for i in range(10)]
            ax.scatter(d7["x"].numpy(), [0] * 10, c=colors, zorder=3)
            for i in range(10):
                g = float(grad[i]) / scale
                if abs(g) > 1e-3:
                    ax.annotate("", xy=(i + 0.9 * g, 0), xytext=(i, 0),
                                arrowprops={"arrowstyle": "->", "color": colors[i], "lw": 1.5})
            ax.set_title(f"({name}) I = {index} (orange); eps {eps:g}, {row_scaling} scaling", fontsize=9)
            ax.set_yticks([])
            ax.set_xlim(-1, 10)
    for ax in axes[-1]:
        ax.set_xlabel("score x_i; arrow: df/dx_i (longest = 0.9)")
    fig.suptitle(f"gradient of f = sum over I of A_i, top-{d7['k']} of x = 0..9", fontsize=10)
    fig.tight_layout()
    paths["fig7"] = os.path.join(out_dir, "fig7_gradient_field.png")
    fig.savefig(paths["fig7"], dpi=110)
    plt.close(fig)
    return paths


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m softtopk_fairseq.tools.plot_operator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/figures")
    p.add_argument("--scaling", choices=["paper", "none"], default="paper")
    p.add_argument("--epsilons", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1])
    p.add_argument("--fig7-epsilon", type=float, default=1.0, help="temperature (score units) of Figure 7's top row")
    return p


def main(argv=None) -> Dict[str, str]:
    args = parser().parse_args(argv)
    paths = draw(args.out, args.epsilons, args.fig7_epsilon, args.scaling)
    for path in paths.values():
        print(path)
    return paths


if __name__ == "__main__":
    main()
