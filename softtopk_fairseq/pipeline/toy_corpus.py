"""A generated English -> French-like parallel corpus for the offline demo.

It is small enough for a tiny model to learn in minutes on a CPU, yet it has what makes beam search
matter in real translation:

* **reordering**: colour adjectives follow the noun in French (``the red car`` -> ``la voiture rouge``);
* **agreement**: article, adjectives and verb agree with the noun's gender and number, and the French
  article comes *before* the noun that decides it (``the small houses`` -> ``les petites maisons``);
* **contractions**: ``de`` + article -> ``du`` / ``de la`` / ``des``;
* **ambiguity with a greedy trap**: some English words have several translations. The most likely
  *single* translation starts with a token that is *less* likely than the shared first token of the
  others (``near`` -> ``près de`` 40 %, ``à côté de`` / ``à proximité de`` / ``à deux pas de`` 20 % each).
  Greedy decoding commits to ``à`` (60 %) and ends on a 20 % phrase; beam search keeps ``près`` alive and
  finds the mode.

Every sentence is lower-cased, space-tokenised and ends with `` .``. Generation is deterministic for a
seed.
"""
import random
from typing import Iterator, List, Sequence, Tuple

# English noun -> (French noun, gender). Plurals add "s" on both sides (regular by construction).
NOUNS = {
    "cat": ("chat", "m"), "dog": ("chien", "m"), "book": ("livre", "m"), "boy": ("garçon", "m"),
    "bird": ("oiseau", "m"), "man": ("homme", "m"), "horse": ("cheval", "m"), "garden": ("jardin", "m"),
    "tree": ("arbre", "m"), "train": ("train", "m"), "hat": ("chapeau", "m"), "friend": ("ami", "m"),
    "car": ("voiture", "f"), "house": ("maison", "f"), "table": ("table", "f"), "girl": ("fille", "f"),
    "woman": ("femme", "f"), "door": ("porte", "f"), "street": ("rue", "f"), "flower": ("fleur", "f"),
    "chair": ("chaise", "f"), "boat": ("barque", "f"), "lamp": ("lampe", "f"), "city": ("ville", "f"),
}
PLURAL_EN = {"man": "men", "woman": "women", "city": "cities"}
# Irregular French plurals (the rest add "s").
PLURAL_FR = {"oiseau": "oiseaux", "cheval": "chevaux", "chapeau": "chapeaux"}
# Adjectives placed before the noun: English -> (masc, fem).
ADJ_PRE = {
    "small": ("petit", "petite"), "big": ("grand", "grande"), "pretty": ("joli", "jolie"),
    "good": ("bon", "bonne"), "old": ("vieux", "vieille"),
}
# Colour adjectives placed after the noun.
ADJ_POST = {
    "red": ("rouge", "rouge"), "green": ("vert", "verte"), "black": ("noir", "noire"),
    "white": ("blanc", "blanche"), "blue": ("bleu", "bleue"), "grey": ("gris", "grise"),
}
PLURAL_ADJ = {"vieux": "vieux", "gris": "gris"}
# English verb (3rd person singular, plural) -> French (singular, plural).
VERBS = {
    ("sees", "see"): ("voit", "voient"), ("likes", "like"): ("aime", "aiment"),
    ("watches", "watch"): ("regarde", "regardent"), ("follows", "follow"): ("suit", "suivent"),
    ("finds", "find"): ("trouve", "trouvent"), ("paints", "paint"): ("peint", "peignent"),
}
# English preposition -> weighted French renderings, all followed by "de" + article (contracted).
# The most likely rendering does not share the first token of the others: greedy decoding falls for it.
PREPOSITIONS = {
    "near": [("près", 0.4), ("à côté", 0.2), ("à proximité", 0.2), ("à deux pas", 0.2)],
    "behind": [("à l'arrière", 1.0)],
    "far from": [("loin", 0.4), ("à distance", 0.2), ("à l'écart", 0.2), ("à mille lieues", 0.2)],
    "in front of": [("en face", 0.4), ("à l'avant", 0.2), ("à hauteur", 0.2), ("à la tête", 0.2)],
}


def _pluralise_fr(word: str) -> str:
    if word in PLURAL_FR:
        return PLURAL_FR[word]
    if word in PLURAL_ADJ:
        return PLURAL_ADJ[word]
    return word if word.endswith(("s", "x")) else word + "s"


def _noun_phrase(rng: random.Random) -> Tuple[List[str], List[str], bool, bool]:
    """One noun phrase: (english, french-without-article, plural, definite); the article comes later."""
    en_noun = rng.choice(sorted(NOUNS))
    fr_noun, gender = NOUNS[en_noun]
    plural = rng.random() < 0.35
    definite = rng.random() < 0.6
    g = 0 if gender == "m" else 1
    pre = rng.choice(sorted(ADJ_PRE)) if rng.random() < 0.4 else None
    post = rng.choice(sorted(ADJ_POST)) if rng.random() < 0.5 else None

    en = [PLURAL_EN.get(en_noun, en_noun + "s") if plural else en_noun]
    fr = [_pluralise_fr(fr_noun) if plural else fr_noun]
    if post:
        en.insert(0, post)
        adj = ADJ_POST[post][g]
        fr.append(_pluralise_fr(adj) if plural else adj)
    if pre:
        en.insert(0, pre)
        adj = ADJ_PRE[pre][g]
        fr.insert(0, _pluralise_fr(adj) if plural else adj)
    if definite:
        en.insert(0, "the")
    elif not plural:
        en.insert(0, "a")
    # Article: French has "des" for indefinite plurals; English has none.
    article = (
        ("les" if plural else ("le" if g == 0 else "la"))
        if definite
        else ("des" if plural else ("un" if g == 0 else "une"))
    )
    return en, [article] + fr, plural, definite


def _after_de(fr_np: List[str]) -> List[str]:
    """French ``de`` + noun phrase with the contractions de+le=du, de+les=des, de+des=de."""
    article, rest = fr_np[0], fr_np[1:]
    if article == "le":
        return ["du"] + rest
    if article in ("les",):
        return ["des"] + rest
    if article == "des":
        return ["de"] + rest
    return ["de", article] + rest


def sentence_pair(rng: random.Random) -> Tuple[str, str]:
    """One (english, french) pair."""
    en_s, fr_s, plural_s, _ = _noun_phrase(rng)
    (v_sg, v_pl), (fv_sg, fv_pl) = rng.choice(sorted(VERBS.items()))
    en_o, fr_o, _, _ = _noun_phrase(rng)
    en = en_s + [v_pl if plural_s else v_sg] + en_o
    fr = fr_s + [fv_pl if plural_s else fv_sg] + fr_o
    if rng.random() < 0.6:
        prep = rng.choice(sorted(PREPOSITIONS))
        renderings, weights = zip(*PREPOSITIONS[prep])
        rendering = rng.choices(renderings, weights=weights)[0]
        en_p, fr_p, _, _ = _noun_phrase(rng)
        en += prep.split() + en_p
        fr += rendering.split() + _after_de(fr_p)
    return " ".join(en + ["."]), " ".join(fr + ["."])


LANGUAGES = ("en", "fr")  # what the generated pairs are: English, then French


def generate(n: int, seed: int) -> Iterator[Tuple[str, str]]:
    """``n`` sentence pairs, deterministic for ``seed``."""
    rng = random.Random(seed)
    for _ in range(n):
        yield sentence_pair(rng)


def write_split(prefix: str, n: int, seed: int, langs: Sequence[str] = LANGUAGES) -> None:
    """Write ``{prefix}.{src}`` and ``{prefix}.{tgt}``, one sentence per line, aligned by line."""
    pairs = list(generate(n, seed))
    for side, lang in enumerate(langs):
        with open(f"{prefix}.{lang}", "w", encoding="utf-8") as f:
            f.writelines(pair[side] + "\n" for pair in pairs)
