import argparse
import os
import subprocess
import sys
import warnings

import pytest
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



def _renaming_numpy(path, written_by: int):
    """Rewrite the checkpoint at ``path`` as numpy ``written_by`` (1 or 2) would have pickled it: its pickle names
    numpy's array reconstruction by that version's module (protocol 2 names globals as text lines)."""
    import zipfile

    names = {1: b"numpy.core.multiarray\n", 2: b"numpy._core.multiarray\n"}
    with zipfile.ZipFile(path) as z:
        entries = [(info, z.read(info)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for info, data in entries:
            if info.filename.endswith("/data.pkl"):
                assert names[3 - written_by] in data or names[written_by] in data
                data = data.replace(names[3 - written_by], names[written_by])
            z.writestr(info, data)


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6),
                    reason="torch < 2.6 cannot allow-list an object under another name")
@pytest.mark.parametrize("written_by", [1, 2])
def test_the_numpy_meters_load_whichever_numpy_major_version_wrote_them(tmp_path, written_by):
    """A checkpoint_best.pt written where numpy 1 runs (the lowest supported versions) loads where numpy 2 does,
    and the other way round: its pickle names numpy.core or numpy._core, whichever numpy runs here."""
    import numpy as np

    path = tmp_path / "ckpt.pt"
    torch.save({"args": argparse.Namespace(arch="lstm"), "model": {"w": torch.zeros(2)},
                "extra_state": {"metrics": {"counts": np.array([116, 104, 92, 80]), "best": np.float64(3.5)}}}, path)
    _renaming_numpy(path, written_by)
    assert _load_in_fresh_process(path, "").startswith("REFUSED")
    assert _load_in_fresh_process(path, "import softtopk_fairseq.fairseq_plugin") == "LOADED lstm"

# ------------------------------------------------------------------- checkpoints and flags of version 0.1 ----

V0 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "v0_topk_attn")
# The v0 model's outputs on another CPU: 40x the largest difference measured on one machine made to take other
# CPUs' code paths (2.5e-7 of the largest output with the C kernels for x86-64 and MKL's and torch's AVX2 kernels;
# equal bit for bit on the machine that ran it natively).
V0_TOLERANCE = 1e-5


def test_a_v0_checkpoint_loads_with_its_modes_renamed_and_computes_what_it_did(monkeypatch):
    """A transformer_topk_attn checkpoint written by version 0.1 (tests/fixtures/make_v0_checkpoint.py: saved
    arguments ``topk_attn_mode='soft'``, ``topk_attn_inference='hard'``) loads through fairseq's own loader: the
    modes come out under their names now (upgrade_args, with a warning), and the model's output in training and
    in eval mode is what 0.1 computed: within V0_TOLERANCE of its largest magnitude (other CPUs round otherwise)."""
    from fairseq import checkpoint_utils

    import softtopk_fairseq.fairseq_plugin  # noqa: F401
    from softtopk_fairseq.modules import relaxations

    monkeypatch.setattr(relaxations, "_warned", set())
    with pytest.warns(FutureWarning, match="'soft' is the old name of 'soft_topk'"):
        models, cfg = checkpoint_utils.load_model_ensemble(
            [os.path.join(V0, "checkpoint.pt")], arg_overrides={"data": V0, "source_lang": "en", "target_lang": "fr"})
    model = models[0]
    layers = [m for m in model.modules() if hasattr(m, "topk_mode")]
    assert layers and {(m.topk_mode, m.topk_inference) for m in layers} == {("soft_topk", "hard_topk")}
    expected = torch.load(os.path.join(V0, "expected.pt"))
    src, lengths, prev = expected["batch"]
    for mode in ("train", "eval"):
        getattr(model, mode)()
        torch.manual_seed(0)
        with torch.no_grad():
            want = expected["outputs"][mode]
            torch.testing.assert_close(model(src, lengths, prev)[0], want, rtol=0,
                                       atol=V0_TOLERANCE * want.abs().max().item(), msg=mode)


def test_a_v0_criterion_config_means_what_it_meant(monkeypatch):
    """The checkpoint's saved criterion config (0.1's flags: --soft-topk-method perturbed --perturbed-sigma 0.3
    --perturbed-samples 4) builds the criterion fairseq's way, into the new flags' values."""
    from fairseq import checkpoint_utils, tasks

    import softtopk_fairseq.criterions.soft_beam_search as criterion_module
    from tiny_models import TinyTask, dictionary

    monkeypatch.setattr(criterion_module, "_warned_flags", set())
    saved = checkpoint_utils.load_checkpoint_to_cpu(os.path.join(V0, "checkpoint.pt"))["cfg"].criterion
    assert (saved["soft_topk_method"], saved["perturbed_sigma"], saved["perturbed_samples"]) == ("perturbed", 0.3, 4)
    with pytest.warns(FutureWarning, match="--soft-topk-method is the old name of --soft-beam-relaxation"):
        criterion = tasks.FairseqTask.build_criterion(TinyTask(dictionary()), saved)
    assert (criterion.search_options["relaxation"], criterion.search_options["epsilon"],
            criterion.search_options["samples"]) == ("perturbed", 0.3, 4)


@pytest.mark.parametrize("old, new", [
    (dict(soft_topk_method="ot", soft_topk_epsilon=0.5), dict(relaxation="soft_topk", epsilon=0.5)),
    (dict(soft_topk_method="perturbed", perturbed_sigma=0.2, soft_topk_epsilon=0.7),
     dict(relaxation="perturbed", epsilon=0.2)),  # 0.1 took the noise from --perturbed-sigma, ignored the other
    (dict(perturbed_sigma=0.2, soft_topk_scaling="none"), dict(relaxation="soft_topk", epsilon=0.1, scaling="none")),
    (dict(soft_topk_method="softmax_k_times", perturbed_samples=3), dict(relaxation="softmax_k_times", samples=3)),
])
def test_criterion_flags_of_v0_are_aliases_of_the_new_ones(old, new):
    from softtopk_fairseq.criterions.soft_beam_search import SoftBeamSearchConfig, SoftBeamSearchCriterion
    from tiny_models import TinyTask, dictionary

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        criterion = SoftBeamSearchCriterion(TinyTask(dictionary()), SoftBeamSearchConfig(sentence_avg=False, **old))
    assert {name: criterion.search_options[name] for name in new} == new


def test_an_old_flag_that_contradicts_its_new_name_is_refused():
    from softtopk_fairseq.criterions.soft_beam_search import SoftBeamSearchConfig, SoftBeamSearchCriterion
    from tiny_models import TinyTask, dictionary

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ValueError, match="--soft-topk-epsilon 0.5 contradicts --soft-beam-epsilon 0.3"):
            SoftBeamSearchCriterion(TinyTask(dictionary()), SoftBeamSearchConfig(
                sentence_avg=False, soft_topk_epsilon=0.5, soft_beam_epsilon=0.3))


def test_an_old_flag_that_the_relaxation_does_not_take_is_said_to_be_ignored(monkeypatch):
    """0.1 took the perturbed top-k's noise from --perturbed-sigma alone: --soft-topk-epsilon given with it is
    ignored, as it was -- and the warning says so (it said only that the flag was renamed, as if it applied)."""
    import softtopk_fairseq.criterions.soft_beam_search as criterion_module
    from tiny_models import TinyTask, dictionary

    monkeypatch.setattr(criterion_module, "_warned_flags", set())
    cfg = criterion_module.SoftBeamSearchConfig(sentence_avg=False, soft_beam_relaxation="perturbed",
                                                soft_topk_epsilon=0.5)
    with pytest.warns(FutureWarning) as caught:
        criterion = criterion_module.SoftBeamSearchCriterion(TinyTask(dictionary()), cfg)
    assert criterion.search_options["epsilon"] == 0.1
    assert [str(w.message) for w in caught] == [
        "soft_beam_search: --soft-topk-epsilon is the old name of --soft-beam-epsilon; it will be removed (ignored: "
        "the perturbed relaxation does not take it, as in 0.1)"]

