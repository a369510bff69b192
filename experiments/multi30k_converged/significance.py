"""Paired significance tests of one system against a baseline, per seed and pooled over seeds.

Each seed trains its own pair of models (the system and the baseline from the same seed) and translates the same
test set. Per seed, the two hypothesis files are compared with sacrebleu's paired tests on that set; pooled, the
seeds' hypotheses are concatenated -- seed s of the system paired with seed s of the baseline, sentence by
sentence, against the references repeated once per seed -- and compared the same way. The pooled test asks
whether the system is better than the baseline on this test set across training runs; it does not replace the
per-seed spread (a t-test over the per-seed differences is reported beside it).

Both of sacrebleu's paired tests are run, for BLEU and chrF: paired bootstrap resampling (Koehn 2004, 1,000
resamples) and approximate randomisation (10,000 trials; Riezler and Maxwell 2005). sacrebleu seeds its RNG
(``SACREBLEU_SEED``, default 12345), so a report regenerates exactly.
"""
import math
import statistics
from typing import Dict, List, NamedTuple, Optional, Sequence

METRICS = ("BLEU", "chrF")
TESTS = {"bootstrap": ("bs", 1000), "randomisation": ("ar", 10000)}


class Comparison(NamedTuple):
    """One paired comparison on one set of sentences: the two scores and each test's p-value, per metric."""

    baseline: Dict[str, float]      # metric -> corpus score
    system: Dict[str, float]
    p: Dict[str, Dict[str, float]]  # metric -> test name -> p-value

    def delta(self, metric: str) -> float:
        return self.system[metric] - self.baseline[metric]


def _metrics():
    from sacrebleu.metrics import BLEU, CHRF

    return {"BLEU": BLEU(), "chrF": CHRF()}


# sacrebleu's names of the metrics in its results (chrF with its beta: chrF2)
RESULT_NAMES = {"BLEU": "BLEU", "chrF": "chrF2"}


def compare(references: Sequence[str], baseline: Sequence[str], system: Sequence[str]) -> Comparison:
    """sacrebleu's paired bootstrap and approximate randomisation of ``system`` against ``baseline`` on
    ``references`` (one reference per line), for BLEU and chrF."""
    from sacrebleu.significance import PairedTest

    if not len(references) == len(baseline) == len(system):
        raise ValueError(f"compare: {len(references)} references, {len(baseline)} baseline and {len(system)} "
                         "system lines; they must be aligned")
    scores, p = {}, {metric: {} for metric in METRICS}
    for name, (test_type, samples) in TESTS.items():
        _, results = PairedTest([("baseline", list(baseline)), ("system", list(system))], _metrics(),
                                [list(references)], test_type=test_type, n_samples=samples)()
        for metric in METRICS:
            base, sys_ = results[RESULT_NAMES[metric]]
            scores[metric] = (base.score, sys_.score)
            p[metric][name] = sys_.p_value
    return Comparison({m: s[0] for m, s in scores.items()}, {m: s[1] for m, s in scores.items()}, p)


def pooled(references: Sequence[str], baselines: List[Sequence[str]], systems: List[Sequence[str]]) -> Comparison:
    """:func:`compare` on the seeds' hypotheses concatenated (seed s of the system beside seed s of the baseline),
    against the references once per seed."""
    if len(baselines) != len(systems) or not baselines:
        raise ValueError(f"pooled: {len(baselines)} baseline and {len(systems)} system seeds; they must pair up")
    return compare(list(references) * len(systems), [line for b in baselines for line in b],
                   [line for s in systems for line in s])


def t_test_p(differences: Sequence[float]) -> Optional[float]:
    """Two-sided p-value of a one-sample t-test that the mean of the per-seed ``differences`` is 0 (None with
    fewer than two seeds, or no spread)."""
    n = len(differences)
    if n < 2:
        return None
    sd = statistics.stdev(differences)
    if sd == 0:
        return None
    t = statistics.mean(differences) / (sd / math.sqrt(n))
    from scipy.stats import t as student_t

    return float(2 * student_t.sf(abs(t), n - 1))
