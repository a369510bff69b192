"""End to end through fairseq's own command lines with ``--user-dir user_dir`` (like fairseq's
tests/test_binaries.py): dummy data -> preprocess -> train a tiny model -> resume -> generate."""
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


def test_train_help_lists_user_dir_components():
    out = fairseq("train", "--user-dir", USER_DIR, "--help").stdout
    assert "--user-dir" in out and "--criterion" in out


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
