import collections

from softtopk_fairseq.pipeline import toy_corpus


def test_deterministic_for_a_seed():
    assert list(toy_corpus.generate(50, seed=7)) == list(toy_corpus.generate(50, seed=7))
    assert list(toy_corpus.generate(50, seed=7)) != list(toy_corpus.generate(50, seed=8))


def test_agreement_and_reordering():
    pairs = dict(toy_corpus.generate(5000, seed=1))
    # Colour adjectives move after the noun; the article and adjectives agree with gender and number.
    assert any(e.startswith("the small red houses ") and f.startswith("les petites maisons rouges ")
               for e, f in pairs.items())
    assert any(e.startswith("a white car ") and f.startswith("une voiture blanche ") for e, f in pairs.items())
    assert any(" near the cat ." in e and f.endswith(" du chat .") for e, f in pairs.items())
    for e, f in pairs.items():
        assert e.endswith(" .") and f.endswith(" .")


def test_greedy_trap_frequencies():
    """'near' -> 'près de' is the most frequent single rendering, but 'à' is the most frequent first token."""
    first = collections.Counter()
    whole = collections.Counter()
    for e, f in toy_corpus.generate(20000, seed=3):
        if " near " in e:
            words = f.split()
            i = next(i for i, w in enumerate(words) if w in ("près", "à"))
            first[words[i]] += 1
            whole["près" if words[i] == "près" else " ".join(words[i:i + 2])] += 1  # w/o article
    assert first["à"] > first["près"]
    assert whole.most_common(1)[0][0] == "près"
