"""The relaxation registry (modules/relaxations.py): one name per relaxation everywhere, the old names as
aliases that warn once, and a new relaxation is one class and one registry line."""
import warnings

import pytest
import torch

from softtopk_fairseq.modules import relaxations
from softtopk_fairseq.modules.relaxations import Relaxation, Relaxed
from softtopk_fairseq.modules.soft_beam_search import soft_beam_search
from softtopk_fairseq.modules.topk_attention import topk_attention_weights
from tiny_models import batch, build, dictionary


def test_each_use_has_its_relaxations_and_every_alias_resolves_to_one():
    assert relaxations.names("search") == ("soft_topk", "softmax_k_times", "perturbed")
    assert relaxations.names("attention") == ("soft_topk", "perturbed", "hard_topk", "softmax")
    assert set(relaxations.accepted_names("attention")) == {"soft_topk", "perturbed", "hard_topk", "softmax", "ot",
                                                            "soft", "hard"}
    assert set(relaxations.accepted_names("search")) == {"soft_topk", "softmax_k_times", "perturbed", "ot", "soft"}
    for alias, name in relaxations.ALIASES.items():
        assert name in relaxations.names("attention")


def test_an_alias_warns_once_and_a_wrong_name_says_what_is_allowed(monkeypatch):
    monkeypatch.setattr(relaxations, "_warned", set())
    with pytest.warns(FutureWarning, match="'ot' is the old name of 'soft_topk'"):
        assert relaxations.resolve("ot", "search") == "soft_topk"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert relaxations.resolve("ot", "search") == "soft_topk"  # once per process
    with pytest.raises(ValueError, match=r"mode must be one of \('soft_topk', 'perturbed', 'hard_topk', 'softmax'\), "
                                         r"got 'softmax_k_times'"):
        relaxations.resolve("softmax_k_times", "attention", "mode")
    with pytest.raises(ValueError, match="got 'hard_topk'"):
        relaxations.make("hard_topk", "search", 3)
    with pytest.raises(ValueError, match=r"relaxation: use must be one of \('search', 'attention'\), got 'atention'"):
        relaxations.make("soft_topk", "atention", 2)  # (the name was blamed: "must be one of (), got 'soft_topk'")


def test_an_old_name_computes_what_the_new_one_does(monkeypatch):
    monkeypatch.setattr(relaxations, "_warned", set())
    scores = torch.randn(3, 4, 9, dtype=torch.float64)
    for old, new in (("soft", "soft_topk"), ("hard", "hard_topk")):
        with pytest.warns(FutureWarning):
            got = topk_attention_weights(scores, 3, mode=old)
        assert torch.equal(got, topk_attention_weights(scores, 3, mode=new))


@pytest.mark.parametrize("name", relaxations.names("search"))
@pytest.mark.parametrize("scaling", ["paper", "none"])
def test_every_search_relaxation_gives_nan_on_the_rows_the_operator_refuses_and_the_others_as_alone(name, scaling):
    """relax() on kept scores with a NaN or a +inf: NaN on those rows -- as fairseq expects from an overflow -- and
    on the others what they get alone (the perturbed top-k: finite), with finite gradients (softmax_k_times and the
    perturbed top-k once took +inf for a finite score, and gave it a weight). Scores whose paper temperature
    overflows: NaN from the OT operator, which refuses them, the infinite temperature's limit from the others."""
    kept = torch.tensor([[0.3, 0.2, 0.1, 0.0, -0.1], [torch.nan, 2.0, 1.0, 0.0, -1.0],
                         [torch.inf, 2.0, 1.0, 0.0, -1.0], [3e38, -3e38, 1.0, 0.0, -1.0]], requires_grad=True)
    relaxation = relaxations.make(name, "search", 2, 0.1, scaling=scaling)
    A = relaxation.relax(kept).A
    refused = [False, True, True, scaling == "paper" and name == "soft_topk"]
    assert torch.isnan(A).flatten(1).all(-1).tolist() == refused
    assert bool(torch.isfinite(A[0]).all())
    if name != "perturbed":  # (its noise is drawn for the whole batch)
        torch.testing.assert_close(A[:1], relaxation.relax(kept[:1].detach()).A)
    (A[0] * torch.arange(10.0).view(5, 2)).sum().backward()  # (every rank column sums to 1: weighted)
    assert bool(torch.isfinite(kept.grad[0]).all()) and bool(kept.grad[0].abs().sum() > 0)


def test_register_refuses_a_taken_name_an_alias_and_unknown_uses():
    for name, uses in (("soft_topk", {"search"}), ("ot", {"search"}), ("fresh", {"decoding"}), ("", {"search"})):
        cls = type("Bad", (Relaxation,), {"name": name, "uses": frozenset(uses)})
        with pytest.raises(ValueError):
            relaxations.register(cls)


def test_a_new_relaxation_is_one_class_and_one_registry_line(monkeypatch):
    """A relaxation defined outside the package -- here a plain softmax over the candidates repeated for every
    rank, and as attention the softmax at temperature epsilon -- registered with one decorator line, serves the
    beam search and the attention by its name."""
    monkeypatch.setattr(relaxations, "_REGISTRY", dict(relaxations._REGISTRY))

    @relaxations.register
    class RepeatedSoftmax(Relaxation):
        name = "repeated_softmax"
        uses = frozenset({"search", "attention"})

        def _relax(self, kept):
            scaled, temperature = self._divide_by_temperature(kept)
            A = torch.softmax(scaled, -1).unsqueeze(-1).expand(*kept.shape, self.k)
            return Relaxed(A, temperature, None, None)

        def attention_scores(self, scores, dim):
            return scores / self.epsilon

    d = dictionary(10)
    model, sample = build("lstm", d), batch(d)
    ni = sample["net_input"]
    out = soft_beam_search(model, ni["src_tokens"], ni["src_lengths"], sample["target"], pad=d.pad(), eos=d.eos(),
                           beam=2, relaxation="repeated_softmax", epsilon=0.5)
    out.nll.sum().backward()
    assert torch.isfinite(out.nll).all() and model.decoder.embed_tokens.weight.grad is not None
    scores = torch.randn(2, 7, dtype=torch.float64)
    got = topk_attention_weights(scores, 3, mode="repeated_softmax", epsilon=0.5)
    torch.testing.assert_close(got, torch.softmax(scores / 0.5, -1))


PARSE_WITH_USER_DIR = """
import sys
from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

user_dir, name = sys.argv[1:]
args = options.parse_args_and_arch(options.get_training_parser(), [
    "data-bin", "--user-dir", user_dir, "--arch", "transformer_topk_attn", "--criterion", "soft_beam_search",
    "--soft-beam-relaxation", name, "--topk-attn-mode", name])
cfg = convert_namespace_to_omegaconf(args)
print("parsed", cfg.criterion.soft_beam_relaxation, cfg.model.topk_attn_mode)
"""

USER_DIR_INIT = """
from softtopk_fairseq.modules import relaxations
from softtopk_fairseq.modules.relaxations import Relaxation
{before}

@relaxations.register
class MyRelaxation(Relaxation):
    name = "my_relaxation"
    uses = frozenset({{"search", "attention"}})

{after}
"""


@pytest.mark.parametrize("registered_first", [True, False])
def test_a_relaxation_of_ones_own_is_a_flag_value_when_registered_before_the_plugin_is_imported(tmp_path,
                                                                                               registered_first):
    """docs/architecture.md's recipe: a user dir of one's own that registers the relaxation and then imports
    ``softtopk_fairseq.fairseq_plugin`` -- fairseq-train's parser and its config take the new name for both flags.
    Imported the other way round, the flags' choices are already built and the parser refuses the name."""
    import subprocess
    import sys

    from fairseq_cli import REPO_ROOT
    from softtopk_fairseq.pipeline.run import quiet_warnings_env

    plugin = "import softtopk_fairseq.fairseq_plugin  # noqa"
    user_dir = tmp_path / "my_user_dir"
    user_dir.mkdir()
    (user_dir / "__init__.py").write_text(USER_DIR_INIT.format(before="" if registered_first else plugin,
                                                               after=plugin if registered_first else ""))
    proc = subprocess.run([sys.executable, "-c", PARSE_WITH_USER_DIR, str(user_dir), "my_relaxation"], cwd=REPO_ROOT,
                          env=dict(quiet_warnings_env(), OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if registered_first:
        assert proc.returncode == 0 and "parsed my_relaxation my_relaxation" in proc.stdout, proc.stdout[-3000:]
    else:
        assert proc.returncode != 0 and "invalid choice: 'my_relaxation'" in proc.stdout, proc.stdout[-3000:]
