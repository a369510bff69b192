"""Draw a sentence pair's encoder-decoder attention from a checkpoint, one panel per attention mode -- plain
softmax, SOFT top-k, hard top-k (and the perturbed top-k's one random draw) -- like Figure 6 of the paper.

    python -m softtopk_fairseq.tools.plot_attention --path CKPT --data DATA_BIN --subset test --index 3 \\
        --modes softmax soft_topk hard_topk --out attention.png
    python -m softtopk_fairseq.tools.plot_attention --path CKPT --data DATA_BIN \\
        --source "a man is near the house ." --target "un homme est près de la maison ."

The decoder is run with teacher forcing on the pair (the reference target), in eval mode; each panel switches
the inference mode of every top-k attention layer of the model. A model without top-k layers can only be
drawn with ``--modes softmax``. Source and target strings must be in the model's token space (after BPE).
"""
import argparse
import logging
import os
from typing import Dict, List, Optional

import torch

from softtopk_fairseq.modules import relaxations


def load(path: str, data: str):
    import softtopk_fairseq.fairseq_plugin  # noqa: F401  (registers our architectures)
    from fairseq import checkpoint_utils

    models, _, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides={"data": data})
    return models[0].eval(), task


def sentence_pair(task, subset: Optional[str], index: int, source: Optional[str], target: Optional[str]):
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    if source is not None:
        src = src_dict.encode_line(source, add_if_not_exist=False).long()
        tgt = tgt_dict.encode_line(target or "", add_if_not_exist=False).long()
        unknown = [word for words, ids, d in ((source.split(), src, src_dict), ((target or "").split(), tgt, tgt_dict))
                   for word, i in zip(words, ids.tolist()) if i == d.unk()]
        if unknown:  # (drawn as <unk>: most likely text not yet in the model's token space)
            logging.getLogger(__name__).warning("not in the model's vocabulary, drawn as <unk>: %s (apply the "
                                                "model's BPE first)", " ".join(unknown))
    else:
        task.load_dataset(subset)
        size = len(task.dataset(subset))
        if not 0 <= index < size:
            raise SystemExit(f"--index {index}: --subset {subset} has sentences 0..{size - 1}")
        item = task.dataset(subset)[index]
        src, tgt = item["source"], item["target"]
    return src, tgt


def attention_maps(model, task, src, tgt, modes: List[str]) -> Dict[str, torch.Tensor]:
    """Mode -> (target length, source length) attention of the decoder's alignment layer."""
    layers = [m for m in model.modules() if hasattr(m, "topk_inference")]
    if not layers and set(modes) != {"softmax"}:
        raise SystemExit("this model has no top-k attention layers: only --modes softmax can be drawn")
    eos = task.target_dictionary.eos()
    prev = torch.cat([torch.tensor([eos]), tgt[:-1]]).unsqueeze(0)
    maps = {}
    saved = [layer.topk_inference for layer in layers]
    try:
        for mode in modes:
            for layer in layers:
                layer.topk_inference = mode
            with torch.no_grad():
                _, extra = model(src.unsqueeze(0), torch.tensor([src.numel()]), prev)
            attn = extra["attn"][0] if isinstance(extra, dict) else extra
            if attn is None:
                raise SystemExit("the decoder returned no attention (fairseq's alignment layer is off)")
            maps[mode] = attn[0].float()
    finally:
        for layer, mode in zip(layers, saved):
            layer.topk_inference = mode
    return maps


TITLES = {"softmax": "softmax attention", "soft_topk": "SOFT top-k attention", "hard_topk": "hard top-k attention",
          "perturbed": "perturbed top-k attention (one draw)"}  # a panel's title, by attention mode


def plot(maps: Dict[str, torch.Tensor], src_tokens: List[str], tgt_tokens: List[str], out: str) -> None:
    # fairseq leaves the root logger open to DEBUG records: keep matplotlib's font-cache chatter out.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(maps), figsize=(4 + 3.2 * len(maps), 1.5 + 0.35 * len(tgt_tokens)),
                             squeeze=False)
    for ax, (mode, weights) in zip(axes[0], maps.items()):
        ax.imshow(weights.numpy(), cmap="Greys", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(src_tokens)), src_tokens, rotation=90, fontsize=8)
        ax.set_yticks(range(len(tgt_tokens)), tgt_tokens, fontsize=8)
        ax.set_title(TITLES[mode], fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def attention_mode(name: str) -> str:
    """``--modes``' type: an attention relaxation's name, an earlier version's resolved (with a warning)."""
    try:
        return relaxations.resolve(name, "attention", "plot_attention --modes")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m softtopk_fairseq.tools.plot_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", required=True, help="checkpoint")
    p.add_argument("--data", required=True, help="the data-bin directory the model was trained on")
    p.add_argument("--subset", default="test", help="the data split to draw from (default: test)")
    p.add_argument("--index", type=int, default=0, help="sentence id in --subset (default: 0)")
    p.add_argument("--source", help="a source sentence instead of --subset/--index (model tokens)")
    p.add_argument("--target", help="its target sentence (model tokens)")
    p.add_argument("--modes", nargs="+", default=["softmax", "soft_topk", "hard_topk"], type=attention_mode,
                   metavar="{" + ",".join(relaxations.names("attention")) + "}",
                   help="panels, one per attention mode (perturbed: one random draw; default: softmax soft_topk "
                        "hard_topk)")
    p.add_argument("--out", default="attention.png", help="the figure's path (default: attention.png)")
    return p


def main(argv: Optional[List[str]] = None) -> Dict[str, torch.Tensor]:
    p = parser()
    a = p.parse_args(argv)
    if (a.source is None) != (a.target is None):
        p.error("give --source and --target together")
    if not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):  # (before the model runs)
        p.error(f"--out {a.out}: its folder does not exist")
    model, task = load(a.path, a.data)
    src, tgt = sentence_pair(task, a.subset, a.index, a.source, a.target)
    maps = attention_maps(model, task, src, tgt, a.modes)
    plot(maps, [task.source_dictionary[i] for i in src], [task.target_dictionary[i] for i in tgt], a.out)
    print(f"wrote {a.out} ({', '.join(a.modes)}; {tgt.numel()} x {src.numel()})")
    return maps


if __name__ == "__main__":
    main()
