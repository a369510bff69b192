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


def test_an_old_name_computes_what_the_new_one_does(monkeypatch):
    monkeypatch.setattr(relaxations, "_warned", set())
    scores = torch.randn(3, 4, 9, dtype=torch.float64)
    for old, new in (("soft", "soft_topk"), ("hard", "hard_topk")):
        with pytest.warns(FutureWarning):
            got = topk_attention_weights(scores, 3, mode=old)
        assert torch.equal(got, topk_attention_weights(scores, 3, mode=new))


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
