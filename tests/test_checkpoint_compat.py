import argparse
import subprocess
import sys

import torch

CHECK = """
import argparse, sys, torch
{plugin}
try:
    state = torch.load(sys.argv[1], weights_only=True)
except Exception as e:  # torch's UnpicklingError
    print("REFUSED", type(e).__name__)
else:
    print("LOADED", state["args"].arch)
"""


def _load_in_fresh_process(path, plugin_import):
    code = CHECK.format(plugin=plugin_import)
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_plugin_allows_namespace_in_weights_only_load(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"args": argparse.Namespace(arch="lstm"), "model": {"w": torch.zeros(2)}}, path)
    # Without the plugin, torch >= 2.6 refuses the checkpoint: the fix is what makes it load.
    assert _load_in_fresh_process(path, "").startswith("REFUSED")
    assert _load_in_fresh_process(path, "import softtopk_fairseq.fairseq_plugin") == "LOADED lstm"


def test_plugin_allows_the_numpy_meters_of_an_eval_bleu_checkpoint(tmp_path):
    """fairseq's --eval-bleu keeps sacrebleu's counts as int64 numpy arrays in the saved meters (found on a
    checkpoint_best.pt of the converged study's driver); a float64 scalar as well, for good measure."""
    import numpy as np

    path = tmp_path / "ckpt.pt"
    torch.save({"args": argparse.Namespace(arch="lstm"), "model": {"w": torch.zeros(2)},
                "extra_state": {"metrics": {"counts": np.array([116, 104, 92, 80]), "best": np.float64(3.5)}}}, path)
    assert _load_in_fresh_process(path, "").startswith("REFUSED")
    assert _load_in_fresh_process(path, "import softtopk_fairseq.fairseq_plugin") == "LOADED lstm"
