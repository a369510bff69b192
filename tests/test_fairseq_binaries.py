"""End to end through fairseq's own command lines with ``--user-dir user_dir`` (like fairseq's
tests/test_binaries.py): dummy data -> preprocess -> train a tiny model -> resume -> generate."""
import dataclasses
import os
import re

import pytest

from fairseq_cli import USER_DIR, fairseq, tiny_arch

TINY_ARCHS = {arch: tiny_arch(arch) for arch in ("lstm", "transformer")}


@pytest.fixture
def data_bin(toy_data_bin):
    return toy_data_bin


def train(data_bin, save_dir, arch, max_update):
    return fairseq(
        "train", data_bin, "--user-dir", USER_DIR, "--cpu", "--seed", "3", *TINY_ARCHS[arch],
        "--optimizer", "adam", "--lr", "0.005", "--criterion", "label_smoothed_cross_entropy",
        "--label-smoothing", "0.1", "--max-tokens", "400", "--max-update", str(max_update),
        "--save-dir", save_dir, "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "1",
        "--num-workers", "0", "--required-batch-size-multiple", "1",
    ).stdout


# With the slow tests: the default run trains, resumes (the plugin's allow-list) and generates through the same
# command lines in test_soft_beam_cli.py (RNNsearch) and trains and generates a transformer in
# test_topk_attention_cli.py.
@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_train_resume_generate(data_bin, tmp_path, arch):
    save_dir = tmp_path / "ckpt"
    log = train(data_bin, save_dir, arch, max_update=3)
    assert (save_dir / "checkpoint_last.pt").exists(), log[-3000:]

    # Resuming reads checkpoint_last.pt with torch.load(weights_only=True) under torch >= 2.6: the plugin's
    # allow-list is what makes this work.
    log = train(data_bin, save_dir, arch, max_update=6)
    assert re.search(r"[Ll]oaded checkpoint .*checkpoint_last\.pt .*\(epoch \d+ @ 3 updates\)", log), log[-3000:]
    assert re.search(r"num_updates 6\b", log), log[-3000:]

    out = fairseq("generate", data_bin, "--user-dir", USER_DIR, "--cpu", "--path", save_dir / "checkpoint_last.pt",
                  "--gen-subset", "test", "--beam", "2", "--batch-size", "4", "--max-len-b", "20",
                  "--required-batch-size-multiple", "1").stdout
    hyps = re.findall(r"^H-(\d+)\t", out, flags=re.M)
    assert sorted(map(int, hyps)) == list(range(12)), out[-3000:]
    assert "BLEU" in out


def test_fairseq_train_knows_the_plugins_registrations_and_their_flags(data_bin):
    """With ``--user-dir``, fairseq-train lists the plugin's criterion and schedule among its choices and takes
    its architectures (a wrong ``--arch`` lists them all: --help does not), and fairseq's own parser takes every
    flag of the criterion and of the top-k attention architectures; without it, none of them."""
    from fairseq import options
    from fairseq.models import ARCH_MODEL_REGISTRY

    import softtopk_fairseq.fairseq_plugin  # noqa: F401
    from softtopk_fairseq.criterions.soft_beam_search import SoftBeamSearchConfig
    from softtopk_fairseq.models.topk_attention import TransformerTopkAttentionConfig

    ours = sorted(name for name, cls in ARCH_MODEL_REGISTRY.items() if cls.__module__.startswith("softtopk_fairseq"))
    assert {"rnnsearch", "transformer_topk_attn", "lstm_topk_attn", "rnnsearch_topk_attn"} <= set(ours)
    help_text = fairseq("train", "--user-dir", USER_DIR, "--help").stdout
    for name in ("soft_beam_search", "reduce_lr_on_plateau_resumable"):
        assert re.search(rf"[{{,]{name}[,}}]", help_text), name
    arches = fairseq("train", data_bin, "--user-dir", USER_DIR, "--arch", "none_such", check=False).stdout
    for name in ours:
        assert f"'{name}'" in arches, name
    plain = fairseq("train", "--help").stdout
    assert not any(name in plain for name in ("soft_beam_search", "topk_attn", "rnnsearch", "resumable"))
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(data_bin), "--user-dir", USER_DIR, "--criterion", "soft_beam_search", "--arch", "transformer_topk_attn",
        "--soft-beam-relaxation", "perturbed", "--topk-attn-mode", "hard_topk"])
    assert (args.soft_beam_relaxation, args.topk_attn_mode) == ("perturbed", "hard_topk")
    for config in (SoftBeamSearchConfig, TransformerTopkAttentionConfig):
        for f in dataclasses.fields(config):
            assert f.name.startswith("_") or hasattr(args, f.name), f.name


def test_user_dir_works_without_installing_package(tmp_path):
    """``--user-dir`` of a plain clone works even when softtopk_fairseq is not importable by itself."""
    import subprocess
    import sys

    repo = os.path.dirname(USER_DIR)
    # Hide the editable install (a path entry or an __editable__ finder) so only user_dir can help.
    code = (
        "import sys, os, importlib.util;"
        f"sys.path = [p for p in sys.path if os.path.abspath(p or '.') != {repo!r}];"
        "sys.meta_path = [f for f in sys.meta_path if '__editable__' not in repr(f)];"
        "assert importlib.util.find_spec('softtopk_fairseq') is None, 'precondition: package hidden';"
        f"spec = importlib.util.spec_from_file_location('user_dir', os.path.join({USER_DIR!r}, '__init__.py'));"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m);"
        "import softtopk_fairseq; print(softtopk_fairseq.__file__)"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert os.path.dirname(os.path.dirname(out.stdout.strip())) == repo
