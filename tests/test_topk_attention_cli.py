"""``transformer_topk_attn`` and ``lstm_topk_attn`` through fairseq's command lines."""
import re

import pytest
import torch

from fairseq_cli import USER_DIR, fairseq, tiny_arch

ARCH_ARGS = {arch: tiny_arch(arch) for arch in ("rnnsearch_topk_attn", "transformer_topk_attn", "lstm_topk_attn")}
ARCH_ARGS["transformer_topk_attn"] += ["--topk-attn-layers", "encoder-decoder,decoder-self"]


# The transformer in the default run (its three attentions, the plot); the other two archs' command lines with
# the slow tests -- their layers are tested in test_topk_attention.py and through the golden cases.
@pytest.mark.parametrize("arch", [a if a == "transformer_topk_attn" else pytest.param(a, marks=pytest.mark.slow)
                                  for a in sorted(ARCH_ARGS)])
def test_train_and_generate_soft_and_hard(toy_data_bin, tmp_path, arch):
    save = tmp_path / "ckpt"
    log = fairseq("train", toy_data_bin, "--user-dir", USER_DIR, "--cpu", "--seed", "3", *ARCH_ARGS[arch],
                  "--topk-attn-k", "3", "--topk-attn-epsilon", "0.1", "--optimizer", "adam",
                  "--lr", "0.005", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
                  "--max-tokens", "400", "--max-update", "3", "--save-dir", save, "--no-epoch-checkpoints",
                  "--log-format", "simple", "--log-interval", "1", "--num-workers", "0",
                  "--required-batch-size-multiple", "1").stdout
    assert re.search(r"num_updates 3\b", log), log[-3000:]
    assert "Topk" in log or "AdditiveAttention" in log  # the model printout names the attention layers
    common = [toy_data_bin, "--user-dir", USER_DIR, "--cpu", "--path", save / "checkpoint_last.pt",
              "--gen-subset", "test", "--beam", "3", "--batch-size", "5", "--max-len-b", "20",
              "--required-batch-size-multiple", "1", "--print-alignment"]
    for overrides in (None, "{'topk_attn_inference': 'hard_topk'}", "{'topk_attn_inference': 'softmax'}"):
        extra = ["--model-overrides", overrides] if overrides else []
        out = fairseq("generate", *common, *extra).stdout
        assert sorted(map(int, re.findall(r"^H-(\d+)\t", out, flags=re.M))) == list(range(12)), out[-3000:]
        assert re.search(r"^A-\d+\t\d+-\d+", out, flags=re.M), out[-2000:]  # alignments from the attention
        if overrides:  # the override reaches the layers of the loaded model, as fairseq-generate loads it
            import ast

            from fairseq import checkpoint_utils

            import softtopk_fairseq.fairseq_plugin  # noqa: F401
            models, _ = checkpoint_utils.load_model_ensemble([str(save / "checkpoint_last.pt")],
                                                             arg_overrides=ast.literal_eval(overrides))
            modes = {m.topk_inference for m in models[0].modules() if hasattr(m, "topk_inference")}
            assert modes == {ast.literal_eval(overrides)["topk_attn_inference"]}
    if arch == "transformer_topk_attn":
        from softtopk_fairseq.tools import plot_attention

        png = tmp_path / "attention.png"
        maps = plot_attention.main(["--path", str(save / "checkpoint_last.pt"), "--data", str(toy_data_bin),
                                    "--subset", "test", "--index", "2", "--out", str(png)])
        assert png.stat().st_size > 1000 and set(maps) == {"softmax", "soft_topk", "hard_topk"}
        for weights in maps.values():
            torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[0]))
        # hard top-k, head-averaged over 2 heads: at most 2 * k = 6 keys per query
        assert int((maps["hard_topk"] > 0).sum(-1).max()) <= 6
        assert not torch.equal(maps["soft_topk"], maps["softmax"])
