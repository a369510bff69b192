"""The converged study's results page, regenerated from its ledgers and kept hypotheses alone (no workdir):

    python experiments/multi30k_converged/driver.py report \\
        --pair experiments/multi30k_converged/en_fr.jsonl ../shared/data/multi30k_en_fr \\
        --pair experiments/multi30k_converged/en_de.jsonl ../shared/data/multi30k_en_de \\
        --out docs/results/multi30k_converged.md --plot docs/figures/multi30k_converged_bleu.png

Each ``--pair LEDGER DATA`` reads a ledger, its hypotheses ``LEDGER.hyps/KEY.SUBSET.TGT.gz`` and the references
``DATA/val.TGT`` and ``DATA/test_2016_flickr.TGT`` (the raw files the study prepared; ``--valid-name`` and
``--test-name`` for others). Every score is recomputed from the hypotheses (BLEU as the ledger has it, and chrF);
every comparison is tested per seed and pooled over the seeds (``significance.py``). The tests' results are cached
beside each ledger (``LEDGER.tests.json``, keyed by the hypotheses' and references' hashes): a page regenerates in
seconds, and exactly, as long as nothing changed. The blind test sets' hypotheses (``LEDGER.blind/``) are never
read here.
"""
import gzip
import hashlib
import json
import os
import re
import statistics
from typing import Dict, List, NamedTuple, Optional, Tuple

from significance import Comparison, METRICS, compare, pooled, t_test_p
from tuning import TUNE_CONTROL, control_rates, tune_lr_choice

SUBSETS = ("valid", "test")
SUBSET_NAMES = {"valid": "val", "test": "test"}
ATTENTION_ARMS = ("softmax", "soft_topk", "hard_topk", "perturbed", "perturbed_64", "softmax_patience10")
ARM_NAMES = {"softmax": "softmax", "soft_topk": "SOFT top-k", "hard_topk": "hard top-k",
             "perturbed": "perturbed top-k (16 samples)", "perturbed_64": "perturbed top-k (64 samples)",
             "softmax_patience10": "softmax, patience 10", "tf": "continued teacher forcing",
             "soft_beam_paper": "soft beam search (paper's setting)", "softmax_k_times": "softmax-k-times",
             "soft_beam_topk_bookkeeping": "soft beam search with topk bookkeeping",
             "soft_beam_nats": "soft beam search with topk bookkeeping in nats", "start": "starting checkpoint",
             "soft_beam_rho05": "soft beam search, rho 0.5"}
# The comparisons reported: (system, baseline) arms of one stage, each tested per seed and pooled.
ATTENTION_COMPARISONS = [("soft_topk", "softmax"), ("hard_topk", "softmax"), ("soft_topk", "hard_topk"),
                         ("perturbed", "hard_topk"), ("perturbed_64", "perturbed"),
                         ("softmax_patience10", "softmax"), ("soft_topk", "softmax_patience10"),
                         ("hard_topk", "softmax_patience10")]
FINETUNE_COMPARISONS = [("soft_beam_paper", "tf"), ("softmax_k_times", "tf"), ("soft_beam_paper", "start"),
                        ("tf", "start")]
SWEEP = ("soft_beam_paper", "soft_beam_topk_bookkeeping", "soft_beam_nats")
# The fine-tunings to convergence (stage ``tune``): the arms, the control, and the comparisons.
TUNE_ARMS = ("start", "tf", "soft_beam_paper", "soft_beam_rho05")
TUNE_COMPARISONS = [("soft_beam_paper", "tf"), ("soft_beam_rho05", "tf"), ("soft_beam_paper", "soft_beam_rho05"),
                    ("tf", "start"), ("soft_beam_paper", "start"), ("soft_beam_rho05", "start")]
TUNE_SEEDS = 3  # per arm: the study's plan


class Pair(NamedTuple):
    """One language pair's study: its ledger rows, hypotheses and references."""

    name: str        # as the rows record it (``en-fr``), else the ledger's file name
    ledger: str
    tgt: str
    rows: Dict[str, dict]
    hyps_dir: str
    references: Dict[str, List[str]]  # subset -> lines

    def hypotheses(self, key: str, subset: str) -> Optional[List[str]]:
        path = os.path.join(self.hyps_dir, f"{key}.{subset}.{self.tgt}.gz")
        if not os.path.exists(path):
            return None
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read().splitlines()


def _read_lines(path: str) -> List[str]:
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def load_pair(ledger: str, data: str, tgt: str, valid_name: str = "val", test_name: str = "test_2016_flickr") -> Pair:
    """The study of one ledger (missing: no runs yet), its hypotheses beside it, the references of target language
    ``tgt`` in ``data``."""
    rows = {}
    if os.path.exists(ledger):
        with open(ledger, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    rows[row["key"]] = row
    names = {row.get("pair") for row in rows.values()} - {None}
    name = names.pop() if len(names) == 1 else re.sub(r"\.jsonl$", "", os.path.basename(ledger)).replace("_", "-")
    references = {subset: _read_lines(os.path.join(data, f"{raw}.{tgt}"))
                  for subset, raw in (("valid", valid_name), ("test", test_name))}
    return Pair(name, ledger, tgt, rows, re.sub(r"\.jsonl$", "", ledger) + ".hyps", references)


# ------------------------------------------------------------------------------------------- the arms ----

def arm_keys(pair: Pair, stage: str, arm: str) -> Dict[int, str]:
    """seed -> ledger key of an arm. ``start``: the pre-training each seed's fine-tunings started from -- of stage
    ``tune``, the one its rows name; of stage ``finetune`` (whose rows name none), the seed's last pre-training or
    rerun recorded before its first fine-tuning (``--retrain-missing`` trains a rerun into the original's folder,
    which the fine-tunings recorded after it started from; one recorded after them did not)."""
    keys = {}
    if stage == "tune" and arm == "start":
        return dict(sorted({row["seed"]: row["start"] for row in pair.rows.values() if row["stage"] == "tune"}.items()))
    if stage == "tune":  # the runs at the rate the study chose (the control also ran at the others, on one seed)
        rate = tune_rate(pair)
        return dict(sorted((row["seed"], key) for key, row in pair.rows.items()
                           if row["stage"] == "tune" and row["method"] == arm and row["lr"] == rate))
    if stage == "finetune" and arm == "start":
        latest = {}  # seed -> its pre-training recorded last so far, in ledger order
        for key, row in pair.rows.items():
            if row["stage"] in ("pretrain", "rerun"):
                latest[row["seed"]] = key
            elif row["stage"] == "finetune" and row["seed"] not in keys and row["seed"] in latest:
                keys[row["seed"]] = latest[row["seed"]]
        return dict(sorted(keys.items()))
    for key, row in pair.rows.items():
        if row["stage"] == stage and row["method"] == arm:
            keys[row["seed"]] = key
    return dict(sorted(keys.items()))


def tune_rate(pair: Pair) -> Optional[float]:
    """The learning rate of a pair's fine-tunings to convergence: the one its soft beam-search runs share; before
    the first of them, the driver's choice (:func:`tuning.tune_lr_choice`) among the rates the sweep seed's control
    (the seed that tried several) has run at, highest first as the driver tries them; None before it has run at
    two."""
    rates = {row["lr"] for row in pair.rows.values() if row["stage"] == "tune" and row["method"] != TUNE_CONTROL}
    if len(rates) > 1:
        raise ValueError(f"{pair.ledger}: the soft fine-tunings to convergence ran at several rates: {sorted(rates)}")
    if rates:
        return rates.pop()
    seed, tried = control_sweep(pair)
    return tune_lr_choice(pair.rows, sorted(tried, reverse=True), seed) if len(tried) > 1 else None


def control_sweep(pair: Pair) -> Tuple[Optional[int], Dict[float, float]]:
    """The seed whose control ran at the most rates (the driver's sweep seed; None before any control) and its val
    BLEU at each of them."""
    tried = control_rates(pair.rows)
    seed = max(tried, key=lambda s: len(tried[s]), default=None)
    return seed, tried.get(seed, {})


def _sha(lines: List[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


class Tests:
    """The paired tests of one pair, cached in ``NAME.tests.json`` beside its ledger."""

    def __init__(self, pair: Pair):
        self.pair = pair
        self.path = re.sub(r"\.jsonl$", "", pair.ledger) + ".tests.json"
        self.cache = {}
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                self.cache = json.load(f)
        self.used = set()
        self.count = 0  # paired tests reported (each metric and test type counted)

    def _get(self, key: str, compute) -> Comparison:
        self.used.add(key)
        if key not in self.cache:
            c = compute()
            self.cache[key] = {"baseline": c.baseline, "system": c.system, "p": c.p}
        entry = self.cache[key]
        self.count += sum(len(tests) for tests in entry["p"].values())
        return Comparison(entry["baseline"], entry["system"], entry["p"])

    def seed(self, subset: str, base: List[str], system: List[str]) -> Comparison:
        refs = self.pair.references[subset]
        key = f"{_sha(refs)}:{_sha(base)}:{_sha(system)}"
        return self._get(key, lambda: compare(refs, base, system))

    def pooled(self, subset: str, bases: List[List[str]], systems: List[List[str]]) -> Comparison:
        refs = self.pair.references[subset]
        key = f"pooled:{_sha(refs)}:" + ",".join(f"{_sha(b)}:{_sha(s)}" for b, s in zip(bases, systems))
        return self._get(key, lambda: pooled(refs, bases, systems))

    def score(self, subset: str, hyps: List[str]) -> Dict[str, float]:
        """Corpus BLEU and chrF of one system (from a comparison with itself: its scores)."""
        refs = self.pair.references[subset]
        key = f"score:{_sha(refs)}:{_sha(hyps)}"
        self.used.add(key)
        if key not in self.cache:
            from sacrebleu.metrics import BLEU, CHRF

            self.cache[key] = {"BLEU": BLEU().corpus_score(hyps, [refs]).score,
                               "chrF": CHRF().corpus_score(hyps, [refs]).score}
        return self.cache[key]

    def save(self) -> None:
        kept = {key: value for key, value in self.cache.items() if key in self.used}
        if not kept:  # (a pair without runs yet)
            return
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(kept, f, indent=0, sort_keys=True)
            f.write("\n")


class Result(NamedTuple):
    """One comparison of two arms on one subset: per seed, and pooled."""

    seeds: List[int]
    per_seed: List[Comparison]
    pooled: Optional[Comparison]

    def deltas(self, metric: str) -> List[float]:
        return [c.delta(metric) for c in self.per_seed]


def compare_arms(pair: Pair, tests: Tests, stage: str, system: str, baseline: str, subset: str) -> Optional[Result]:
    """The seeds both arms have, each seed's paired test and the pooled one; None without a common seed."""
    sys_keys, base_keys = arm_keys(pair, stage, system), arm_keys(pair, stage, baseline)
    seeds = [s for s in sys_keys if s in base_keys]
    found = [(s, pair.hypotheses(base_keys[s], subset), pair.hypotheses(sys_keys[s], subset)) for s in seeds]
    found = [(s, b, h) for s, b, h in found if b is not None and h is not None]
    if not found:
        return None
    per_seed = [tests.seed(subset, b, h) for _, b, h in found]
    both = tests.pooled(subset, [b for _, b, _ in found], [h for _, _, h in found]) if len(found) > 1 else None
    return Result([s for s, _, _ in found], per_seed, both)


# --------------------------------------------------------------------------------------------- format ----

def _mean_std(values: List[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def _p(value: Optional[float]) -> str:
    return "-" if value is None else (f"{value:.3f}" if value >= 0.001 else "<0.001")


def _seeded(seeds: List[int], values: List[str]) -> str:
    return ", ".join(f"s{s} {v}" for s, v in zip(seeds, values))


def arm_table(pairs: List[Pair], tests: Dict[str, Tests], stage: str, arms) -> List[str]:
    """Per arm and pair: seeds, mean ± std of BLEU and chrF on val and test, and each seed's test BLEU."""
    lines = ["| arm | pair | seeds | BLEU val | BLEU test | chrF val | chrF test | test BLEU per seed |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        for pair in pairs:
            keys = arm_keys(pair, stage, arm)
            if not keys:
                continue
            scores = {subset: [tests[pair.name].score(subset, pair.hypotheses(k, subset)) for k in keys.values()]
                      for subset in SUBSETS}
            cells = [_mean_std([s[m] for s in scores[subset]]) for m in METRICS for subset in SUBSETS]
            lines.append(f"| {ARM_NAMES.get(arm, arm)} | {pair.name} | {len(keys)} | "
                         f"{cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | "
                         f"{_seeded(list(keys), ['%.2f' % s['BLEU'] for s in scores['test']])} |")
    return lines


def comparison_table(pairs: List[Pair], tests: Dict[str, Tests], stage: str, comparisons) -> Tuple[List[str], dict]:
    """Per comparison, pair and subset: the per-seed BLEU and chrF differences, their mean, the pooled differences
    with their paired bootstrap and approximate-randomisation p-values, and the t-test over seeds. Also returns the
    results, for the summary."""
    lines = ["| comparison | pair | subset | BLEU difference per seed | pooled BLEU difference | pooled p (bootstrap / "
             "randomisation) | chrF difference per seed | pooled chrF difference | pooled p (bootstrap / "
             "randomisation) | t-test p over seeds (BLEU) |", "|---|---|---|---|---|---|---|---|---|---|"]
    found = {}
    for system, baseline in comparisons:
        for pair in pairs:
            for subset in SUBSETS:
                result = compare_arms(pair, tests[pair.name], stage, system, baseline, subset)
                if result is None:
                    continue
                found[(system, baseline, pair.name, subset)] = result
                cells = []
                for metric in METRICS:
                    cells.append(_seeded(result.seeds, [f"{d:+.2f}" for d in result.deltas(metric)]))
                    if result.pooled is None:
                        cells += ["-", "-"]
                    else:
                        p = result.pooled.p[metric]
                        cells += [f"{result.pooled.delta(metric):+.2f}",
                                  f"{_p(p['bootstrap'])} / {_p(p['randomisation'])}"]
                lines.append(f"| {ARM_NAMES.get(system, system)} - {ARM_NAMES.get(baseline, baseline)} | "
                             f"{pair.name} | {SUBSET_NAMES[subset]} | "
                             + " | ".join(cells) + f" | {_p(t_test_p(result.deltas('BLEU')))} |")
    return lines, found


def per_seed_tests(studies: Dict[str, dict]) -> List[str]:
    """Each seed's own paired tests (BLEU and chrF, bootstrap / randomisation), seeds labelled, of each study (its
    name -> the results of its comparison table: two studies may hold the same comparison)."""
    lines = ["| study | comparison | pair | subset | seed | BLEU difference | p (bootstrap / randomisation) | chrF "
             "difference | p (bootstrap / randomisation) |", "|---|---|---|---|---|---|---|---|---|"]
    for study, found in studies.items():
        for (system, baseline, pair, subset), result in found.items():
            for seed, c in zip(result.seeds, result.per_seed):
                cells = []
                for metric in METRICS:
                    cells += [f"{c.delta(metric):+.2f}", f"{_p(c.p[metric]['bootstrap'])} / "
                                                         f"{_p(c.p[metric]['randomisation'])}"]
                lines.append(f"| {study} | {ARM_NAMES.get(system, system)} - {ARM_NAMES.get(baseline, baseline)} | "
                             f"{pair} | {SUBSET_NAMES[subset]} | {seed} | " + " | ".join(cells) + " |")
    return lines


def wall_seconds(row: dict) -> float:
    """A run's training wall time: every start's, first to last log line, added up (a resumed run has several);
    rows written before the ledger kept each start's have only the last start's, ``train_s``."""
    return float(sum(row["train_s_starts"])) if row.get("train_s_starts") else float(row["train_s"])


def best_epoch(row: dict) -> Optional[int]:
    """The epoch of a run's best validation (fairseq keeps the last of equal scores), None without validations."""
    best = max(row["val_curve"], key=lambda p: (p["bleu"], p["updates"])) if row["val_curve"] else None
    return best["epoch"] if best else None


def early_stopping_patience(row: dict) -> str:
    """The ``--patience`` a run trained with, as its ledger row records it ("-": none given)."""
    extra = row.get("extra", [])
    return extra[extra.index("--patience") + 1] if "--patience" in extra[:-1] else "-"


def rule_stop(row: dict) -> Optional[int]:
    """The epoch early stopping ends a run at, by its rule applied to its val curve: the first epoch ``--patience``
    validations after the last strict gain (fairseq's ``should_stop_early``); None when the curve never gets there."""
    patience = early_stopping_patience(row)
    if patience == "-":
        return None
    best, since = None, 0
    for point in row["val_curve"]:
        if best is None or point["bleu"] > best:
            best, since = point["bleu"], 0
        else:
            since += 1
            if since >= int(patience):
                return point["epoch"]
    return None


def stopping_check(pairs: List[Pair], stage: str, arms) -> str:
    """Whether each run stopped where its early-stopping rule, applied to its own val curve, says -- a restart that
    lost the rule's count trains on -- and, where it did not, whether the checkpoint scored is still the rule's."""
    late = []
    for arm in arms:
        for pair in pairs:
            for key in arm_keys(pair, stage, arm).values():
                row = pair.rows[key]
                stop = rule_stop(row)
                if stop is None or stop == row["epochs"]:
                    continue
                best = best_epoch(row)
                late.append(f"{pair.name} `{key}` trained to epoch {row['epochs']}, where its rule stops at {stop}; "
                            + (f"its best epoch ({best}) is before that, so the checkpoint scored is the rule's"
                               if best is not None and best <= stop else
                               f"its best epoch ({best}) is after that: the checkpoint scored is not the rule's"))
    if not late:
        return ("Every run stopped at the epoch its early-stopping rule gives on its own val curve, the runs "
                "continued after an interruption included.")
    return ("Every other run stopped at the epoch its rule gives on its own val curve. A run continued after an "
            "interruption trains on past that epoch when its restart loses early stopping's count: "
            + "; ".join(late) + ".")


def selection_note(pairs: List[Pair], stage: str, arms) -> str:
    """How many validations each arm's checkpoints were chosen among, and its mean best val BLEU (fairseq's, the
    curves') within the first as many as the fewest any run of the first arm made and over all: a best of more
    noisy validations is higher by chance alone, so an arm that trains longer gains on val by selection too
    ("" without runs)."""
    parts = []
    for pair in pairs:
        curves = {arm: [pair.rows[key]["val_curve"] for key in arm_keys(pair, stage, arm).values()] for arm in arms}
        curves = {arm: runs for arm, runs in curves.items() if runs and all(runs)}
        if not curves:
            continue
        counts = {arm: [len(curve) for curve in runs] for arm, runs in curves.items()}
        first = next(iter(curves))  # (the control: its fewest validations set the common budget)
        budget = min(counts[first])

        def mean_best(runs, n=None):
            return statistics.mean(max(point["bleu"] for point in curve[:n]) for curve in runs)

        among = ", ".join(f"{ARM_NAMES.get(arm, arm)} {min(c)}-{max(c)} (mean {statistics.mean(c):.1f})"
                          for arm, c in counts.items())
        within = ", ".join(f"{ARM_NAMES.get(arm, arm)} {mean_best(runs, budget):.2f}" for arm, runs in curves.items())
        overall = ", ".join(f"{mean_best(runs):.2f}" for runs in curves.values())
        parts.append(f"{pair.name}: validations per run {among}; best val BLEU within each run's first {budget} "
                     f"(the fewest a run of {ARM_NAMES.get(first, first)} made), mean "
                     f"over seeds: {within}; over all of them: {overall}")
    if not parts:
        return ""
    return ("Each checkpoint is its run's best of its validations, and a best of more noisy validations is higher by "
            "chance alone, so an arm that trains longer also gains on val by selection: " + "; ".join(parts)
            + " (fairseq's val BLEU, as the figure plots it). Later validations can hold real gains as well as "
            "luck; test_2016_flickr took no part in the choice.")


def convergence_table(pairs: List[Pair], stage: str, arms) -> List[str]:
    """Epochs to convergence per run (every run of ``stage`` and arm, keys shown): the early-stopping patience it
    trained with, the best validation's epoch, the epoch early stopping ended at, and the training's wall hours
    (2 CPU cores, other work beside it)."""
    lines = ["| arm | pair | patience | best epoch / stopped at, per seed | training hours, per seed | converged |",
             "|---|---|---|---|---|---|"]
    for arm in arms:
        for pair in pairs:
            keys = arm_keys(pair, stage, arm)
            if not keys:
                continue
            epochs, hours = [], []
            for key in keys.values():
                row = pair.rows[key]
                epochs.append(f"{best_epoch(row) or '-'} / {row['epochs']}")
                hours.append(f"{wall_seconds(row) / 3600:.1f}")
            patience = ", ".join(sorted({early_stopping_patience(pair.rows[k]) for k in keys.values()}))
            converged = sum(bool(pair.rows[k]["converged"]) for k in keys.values())
            lines.append(f"| {ARM_NAMES.get(arm, arm)} | {pair.name} | {patience} | {_seeded(list(keys), epochs)} | "
                         f"{_seeded(list(keys), hours)} | {converged}/{len(keys)} |")
    return lines


def rerun_table(pairs: List[Pair]) -> List[str]:
    """Pre-trainings trained again from scratch (``--retrain-missing``): did they reproduce the original?"""
    lines, notes = [], []
    for pair in pairs:
        for key, row in pair.rows.items():
            original = pair.rows.get(re.sub(r"\.rerun\d*$", "", key)) if row["stage"] == "rerun" else None
            if original is None:
                continue
            if not lines:
                lines = ["Checkpoints are not kept once a run is scored; a pre-training that a later fine-tuning "
                         "started from was trained again by its ledger row's recipe (each fine-tuning of the "
                         "converged study names the run it started from):", "",
                         "| rerun | of | pair | epochs (original / rerun) | best update | BLEU val | BLEU test |",
                         "|---|---|---|---|---|---|---|"]
            lines.append(f"| {key} | {original['key']} | {pair.name} | {original['epochs']} / {row['epochs']} | "
                         f"{original['best_updates']} / {row['best_updates']} | {original['bleu']['valid']:.2f} / "
                         f"{row['bleu']['valid']:.2f} | {original['bleu']['test']:.2f} / {row['bleu']['test']:.2f} |")
            notes.append(f"{key} differs from {original['key']} by {row['bleu']['valid'] - original['bleu']['valid']:+.2f} "
                         f"BLEU on val and {row['bleu']['test'] - original['bleu']['test']:+.2f} on test")
    if notes:
        lines += ["", "The same seed trained again did not give the same run (the cause is not traced): "
                  + "; ".join(notes) + " -- a measure of the noise between two runs of one seed."]
    return lines


def pruning_section(pairs: List[Pair]) -> List[str]:
    """The pruning comparison that chose M for the fine-tunings (``--candidates auto``)."""
    lines = []
    for pair in pairs:
        for row in pair.rows.values():
            if row["stage"] != "pruning":
                continue
            lines += [f"Pruning on {row['key']} ({pair.name}; L_SOFT alone, the same batches, eval mode):", "",
                      "| setting | M | L_SOFT (nats/token) | gradient cosine to exact | gradient norm / exact | "
                      "pruned-mass bound / step | duplicate beams |", "|---|---|---|---|---|---|---|"]
            lines += [f"| {q['setting']} | {q['candidates'] or 'exact'} | {q['soft_loss']:.4f} | {q['grad_cosine']:.6f} "
                      f"| {q['grad_norm_ratio']:.4f} | {q['pruned_mass']:.3g} | {q['duplicate_rate']:.2f} |"
                      for q in row["rows"]]
            lines.append("")
    return lines


def _signs(result: Result, metric: str) -> str:
    d = result.deltas(metric)
    return f"{sum(x > 0 for x in d)} of {len(d)} seeds"


def _pooled_claim(result: Optional[Result], metric: str = "BLEU") -> str:
    if result is None:
        return f"{metric} not measured yet"
    if result.pooled is None:  # one seed: its own paired test, no pooling
        p = result.per_seed[0].p[metric]
        return (f"{metric} {result.per_seed[0].delta(metric):+.2f} on seed {result.seeds[0]} alone (p "
                f"{_p(p['bootstrap'])} bootstrap, {_p(p['randomisation'])} randomisation)")
    p = result.pooled.p[metric]
    return (f"{metric} {result.pooled.delta(metric):+.2f} (pooled p {_p(p['bootstrap'])} bootstrap, "
            f"{_p(p['randomisation'])} randomisation; higher on {_signs(result, metric)})")


def _significant(result: Optional[Result], metric: str = "BLEU", alpha: float = 0.05) -> Optional[bool]:
    if result is None or result.pooled is None:
        return None
    p = result.pooled.p[metric]
    return p["bootstrap"] < alpha and p["randomisation"] < alpha


def _outcome(result: Result, metric: str = "BLEU") -> str:
    """What the pooled tests of a comparison say: a gain or a loss (both tests below 0.05; the pooled difference's
    sign), else no measurable difference."""
    if not _significant(result, metric):
        return "no measurable difference"
    return "a gain" if result.pooled.delta(metric) > 0 else "a loss"


def replication(found_attention: dict, pairs: List[Pair]) -> List[str]:
    """Whether the first pair's top-k attention finding holds on each other pair: the same outcome of the pooled
    tests on test BLEU (:func:`_outcome`), judged once the other pair has as many seeds as the first."""
    lines = []
    first = pairs[0] if pairs else None
    for other in pairs[1:]:
        parts = []
        for system in ("soft_topk", "hard_topk"):
            ref = found_attention.get((system, "softmax", first.name, "test"))
            new = found_attention.get((system, "softmax", other.name, "test"))
            if ref is None or ref.pooled is None:
                continue
            label, have = ARM_NAMES[system], len(new.seeds) if new is not None else 0
            if have < len(ref.seeds):
                parts.append(f"{label} against softmax: not decided yet ({have} of {len(ref.seeds)} seeds)")
                continue
            before, now = _outcome(ref), _outcome(new)
            parts.append(f"{label} against softmax: {'it holds' if now == before else 'it does not hold'} -- "
                         f"{first.name} {before} ({ref.pooled.delta('BLEU'):+.2f} BLEU), {other.name} {now}: "
                         f"{_pooled_claim(new)}, t-test over seeds p {_p(t_test_p(new.deltas('BLEU')))}")
        if parts:
            lines.append(f"- **Does the {first.name} top-k attention finding hold on {other.name}?** (test BLEU, "
                         "pooled tests) " + "; ".join(parts) + ".")
    return lines


def soft_against_hard(result: Result) -> str:
    """What the pooled tests say of SOFT against hard top-k attention, on both metrics."""
    if result.pooled is None:
        return "one seed: no pooled test yet."
    if _outcome(result) == _outcome(result, "chrF") == "no measurable difference":
        return "no measurable difference between the two at k 4, epsilon 0.1."
    return (f"SOFT top-k measurably different at k 4, epsilon 0.1: {_outcome(result)} on BLEU, "
            f"{_outcome(result, 'chrF')} on chrF.")


def summary(found_attention: dict, found_finetune: dict, pairs: List[Pair], sweep_line: Optional[str]) -> List[str]:
    """The answers, each computed from the tests (no claim the numbers do not make)."""
    lines = []
    for pair in pairs:
        name = pair.name
        soft = found_attention.get(("soft_topk", "softmax", pair.name, "test"))
        hard = found_attention.get(("hard_topk", "softmax", pair.name, "test"))
        versus = found_attention.get(("soft_topk", "hard_topk", pair.name, "test"))
        if soft is None and hard is None:
            lines.append(f"- **Top-k attention, {name}**: not measured yet.")
            continue
        seeds = max(len(r.seeds) for r in (soft, hard) if r is not None)
        lines.append(f"- **Top-k attention, {name}** ({seeds} seed{'s' * (seeds > 1)}, test_2016_flickr): SOFT top-k "
                     f"against softmax: {_pooled_claim(soft)}, {_pooled_claim(soft, 'chrF')}. Hard top-k against "
                     f"softmax: {_pooled_claim(hard)}, {_pooled_claim(hard, 'chrF')}.")
        if versus is not None:
            lines.append(f"  SOFT against hard top-k: {_pooled_claim(versus)}, {_pooled_claim(versus, 'chrF')} -- "
                         f"{soft_against_hard(versus)}")
    lines += replication(found_attention, pairs)
    for pair in pairs:
        name = pair.name
        beam_val = found_finetune.get(("soft_beam_paper", "tf", pair.name, "valid"))
        beam_test = found_finetune.get(("soft_beam_paper", "tf", pair.name, "test"))
        start = found_finetune.get(("soft_beam_paper", "start", pair.name, "valid"))
        if beam_val is None:
            continue
        below = all(d < 0 for d in start.deltas("BLEU")) if start is not None else False
        lines.append(f"- **Soft beam-search fine-tuning, {name}** ({len(beam_val.seeds)} seeds): against continued "
                     f"teacher forcing, on val {_pooled_claim(beam_val)}; on test {_pooled_claim(beam_test)}."
                     + (f" Below its own starting checkpoint on val on every seed "
                        f"({_seeded(start.seeds, [f'{d:+.2f}' for d in start.deltas('BLEU')])})." if below else ""))
        if sweep_line:
            lines.append(f"  {sweep_line}")
    return lines


def tune_candidates(pairs: List[Pair]) -> str:
    """The search of the soft fine-tunings to convergence, as their rows' ``--soft-beam-candidates`` say it: "M
    candidates per sentence" (0: "the exact search"), "M or N ..." where runs differ; before any run, that none has."""
    found = set()
    for pair in pairs:
        for row in pair.rows.values():
            extra = row.get("extra", [])
            if row["stage"] == "tune" and row["method"] != TUNE_CONTROL and "--soft-beam-candidates" in extra:
                found.add(int(extra[extra.index("--soft-beam-candidates") + 1]))
    if not found:
        return "the candidates per sentence their rows will name (none has run yet)"
    return " or ".join("the exact search" if m == 0 else f"{m}" for m in sorted(found)) + (
        "" if found == {0} else " candidates per sentence")


def soft_started(pair: Pair) -> bool:
    """Whether the ledger holds a soft fine-tuning to convergence of ``pair``."""
    return any(row["stage"] == "tune" and row["method"] != TUNE_CONTROL for row in pair.rows.values())


def tune_rate_line(pair: Pair) -> str:
    """How the fine-tunings' rate was chosen: the control's val BLEU at each rate on the seed that tried them."""
    seed, by_rate = control_sweep(pair)
    tried = sorted(by_rate.items(), reverse=True)
    if len(tried) < 2:
        return f"{pair.name}: the rate is not chosen yet (the control has run at {len(tried)} rate(s) on one seed)."
    rate = tune_rate(pair)
    start = pair.rows.get(arm_keys(pair, "tune", "start").get(seed, ""), {}).get("bleu", {}).get("valid")
    return (f"{pair.name}: the control on seed {seed} reached val BLEU "
            + ", ".join(f"{bleu:.2f} at {lr:g}" for lr, bleu in tried)
            + (f" (its start: {start:.2f})" if start is not None else "")
            + (f"; every run is at {rate:g}." if soft_started(pair) else
               f"; the soft runs, not started yet, run at {rate:g}."))


def tune_summary(found: dict, pairs: List[Pair]) -> List[str]:
    """The answer of the fine-tunings to convergence, per pair: the soft arms against the control, on val and test,
    once there are runs (else how many of the plan are in the ledger)."""
    lines = []
    for pair in pairs:
        runs = {arm: len(arm_keys(pair, "tune", arm)) for arm in TUNE_ARMS[1:]}
        if not any(runs.values()):
            continue
        done = ", ".join(f"{ARM_NAMES[arm]} {n} of {TUNE_SEEDS}" for arm, n in runs.items())
        parts = []
        for system in ("soft_beam_paper", "soft_beam_rho05"):
            val, test = (found.get((system, TUNE_CONTROL, pair.name, subset)) for subset in SUBSETS)
            if val is not None:
                t_p = t_test_p(test.deltas("BLEU"))
                parts.append(f"{ARM_NAMES[system]} against continued teacher forcing: on val {_pooled_claim(val)}; "
                             f"on test {_pooled_claim(test)}, {_pooled_claim(test, 'chrF')}, "
                             + (f"t-test over seeds p {_p(t_p)}" if t_p is not None
                                else "no t-test over seeds (" + ("one seed" if len(test.seeds) < 2 else "no spread") + ")"))
        moved = found.get((TUNE_CONTROL, "start", pair.name, "valid"))
        if moved is not None:
            parts.append(f"the control against its start on val: {_pooled_claim(moved)}")
        lines.append(f"- **Training through beam search, fine-tuned to convergence, {pair.name}** (runs in the "
                     f"ledger: {done}): " + ("; ".join(parts) if parts else "no soft run compared yet") + ".")
    return lines


def tune_curves(pairs: List[Pair], path: str) -> bool:
    """Val BLEU against updates of each fine-tuning to convergence, one panel per arm and pair on shared axes (where
    the arms part, and how long each ran), one line per seed, the start's val BLEU
    dashed; False (nothing drawn) without runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(pair, arm) for pair in pairs for arm in TUNE_ARMS[1:] if arm_keys(pair, "tune", arm)]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False, sharex=True,
                             sharey=True)
    for ax, (pair, arm) in zip(axes[0], panels):
        starts = arm_keys(pair, "tune", "start")
        for seed, key in arm_keys(pair, "tune", arm).items():
            curve = pair.rows[key]["val_curve"]
            ax.plot([p["updates"] for p in curve], [p["bleu"] for p in curve], marker=".", color=f"C{seed - 1}",
                    label=f"seed {seed}")
            start = pair.rows.get(starts.get(seed, ""), {}).get("bleu", {}).get("valid")
            if start is not None:
                ax.axhline(start, color=f"C{seed - 1}", linestyle="--", linewidth=0.8)
        ax.set_title(f"{pair.name}: {ARM_NAMES[arm]}", fontsize=9)
        ax.set_xlabel("updates")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("val BLEU (fairseq, beam 5)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def sweep_summary(pair: Pair, tests: Tests) -> Optional[str]:
    """The sweep's settings on its one seed (val BLEU, which chose; test BLEU beside it)."""
    found = {}
    for name in SWEEP:
        for key, row in pair.rows.items():
            if row["stage"] == "finetune" and row["method"] == name:
                found.setdefault(row["seed"], {})[name] = key
    for seed, keys in found.items():
        if len(keys) == len(SWEEP):
            val, test = ({name: tests.score(subset, pair.hypotheses(keys[name], subset))["BLEU"] for name in SWEEP}
                         for subset in ("valid", "test"))
            spread = {subset: max(v.values()) - min(v.values()) for subset, v in (("val", val), ("test", test))}
            text = ", ".join(f"{ARM_NAMES[n]} {val[n]:.2f} / {test[n]:.2f}" for n in SWEEP)
            return (f"The sweep (seed {seed} only, BLEU val / test): {text} -- a spread of {spread['val']:.2f} on val, "
                    f"which chose, and {spread['test']:.2f} on test; a single run per setting cannot separate them, "
                    "and the paper's setting was kept.")
    return None


# ------------------------------------------------------------------------------------------------ plot ----

def plot(pairs: List[Pair], tests: Dict[str, Tests], path: str) -> None:
    """Per-seed test BLEU of the attention arms, with each system's 95% bootstrap interval (1,000 resamples of its
    test sentences), one panel per pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from sacrebleu.metrics import BLEU

    pairs = [p for p in pairs if arm_keys(p, "attention", "softmax")]  # (a pair without runs yet: no panel)
    arms = [a for a in ("softmax", "soft_topk", "hard_topk", "perturbed", "perturbed_64", "softmax_patience10")
            if any(arm_keys(p, "attention", a) for p in pairs)]
    if not pairs:
        return
    fig, axes = plt.subplots(1, len(pairs), figsize=(5.5 * len(pairs), 3.6), squeeze=False)
    rng = np.random.default_rng(12345)
    for ax, pair in zip(axes[0], pairs):
        refs = pair.references["test"]
        idx = rng.integers(len(refs), size=(1000, len(refs)))
        metric = BLEU()
        for i, arm in enumerate(arms):
            for j, (seed, key) in enumerate(arm_keys(pair, "attention", arm).items()):
                hyps = pair.hypotheses(key, "test")
                stats = np.array(metric._extract_corpus_statistics(hyps, [refs]), dtype="float64")
                samples = np.sort([metric._compute_score_from_stats(list(stats[i_].sum(0))).score for i_ in idx])
                score = tests[pair.name].score("test", hyps)["BLEU"]
                x = i + (j - 1) * 0.2
                ax.errorbar([x], [score], yerr=[[score - samples[25]], [samples[974] - score]], fmt="o",
                            color=f"C{j}", capsize=3, label=f"seed {seed}" if i == 0 else None)
        ax.set_xticks(range(len(arms)))
        ax.set_xticklabels([ARM_NAMES[a].replace(" (", "\n(") for a in arms], fontsize=7)
        ax.set_title(f"Multi30k {pair.name}, test_2016_flickr")
        ax.set_ylabel("BLEU")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------------------------------------ page ----

def _seed_delta(result: Optional[Result], seed: int, metric: str = "BLEU") -> str:
    if result is None or seed not in result.seeds:
        return "-"
    return f"{result.deltas(metric)[result.seeds.index(seed)]:+.2f}"


def lead_change(before: float, after: float) -> str:
    """What a longer-trained baseline does to a system's lead on one seed: ``before`` its difference from the
    patience-5 baseline, ``after`` from the patience-10 one."""
    if before <= 0:
        return "it had no lead to close"
    if after <= 0:
        return "its lead closes"
    if after < before:
        return f"its lead narrows by {before - after:.2f}"
    return "its lead does not narrow"


def curves_part(longer: dict, shorter: dict) -> str:
    """Where the val curve of a run trained again with a longer patience leaves the shorter run's: from the start a
    rerun repeats the shorter run only if it computes bit for bit alike (same code, same CPU thread count)."""
    ours, theirs = ([c["bleu"] for c in row["val_curve"]] for row in (longer, shorter))
    apart = next((e for e, (a, b) in enumerate(zip(ours, theirs), 1) if a != b), None)
    if apart is None:
        return "its val curve repeats the shorter run's up to that run's stop"
    return (f"its val curve differs from the shorter run's from epoch {apart} on (the two did not compute bit for bit "
            "alike), so the difference between them mixes the longer patience with run-to-run variation")


def fairness_line(pair: Pair, found: dict) -> str:
    """The patience-10 softmax run of a pair against its patience-5 run, and whether the top-k arms' lead on test
    BLEU closes against it (one seed: that seed's paired tests)."""
    name = pair.name
    p10 = found.get(("softmax_patience10", "softmax", name, "valid"))
    if p10 is None:
        return f"- {name}: not measured yet."
    seed = p10.seeds[0]
    rows = {arm: pair.rows[arm_keys(pair, "attention", arm)[seed]] for arm in ("softmax", "softmax_patience10")}
    longer_p, shorter_p = (early_stopping_patience(rows[arm]) for arm in ("softmax_patience10", "softmax"))
    run = (f"- {name}, seed {seed}: with patience {longer_p} the softmax run's best epoch is "
           f"{best_epoch(rows['softmax_patience10'])} and it stopped at {rows['softmax_patience10']['epochs']} "
           f"(patience {shorter_p}: {best_epoch(rows['softmax'])} / {rows['softmax']['epochs']}); against the "
           f"patience-{shorter_p} run "
           f"{_seed_delta(p10, seed)} BLEU on val, "
           f"{_seed_delta(found.get(('softmax_patience10', 'softmax', name, 'test')), seed)} on test; "
           f"{curves_part(rows['softmax_patience10'], rows['softmax'])}.")
    leads = []
    for system in ("soft_topk", "hard_topk"):
        longer = found.get((system, "softmax_patience10", name, "test"))
        shorter = found.get((system, "softmax", name, "test"))
        if longer is None or shorter is None or seed not in longer.seeds or seed not in shorter.seeds:
            leads.append(f"{ARM_NAMES[system]}: not measured on seed {seed}")
            continue
        after = longer.per_seed[longer.seeds.index(seed)]
        before = shorter.per_seed[shorter.seeds.index(seed)].delta("BLEU")
        p = after.p["BLEU"]
        leads.append(f"{ARM_NAMES[system]} {after.delta('BLEU'):+.2f} BLEU against it (p {_p(p['bootstrap'])} "
                     f"bootstrap, {_p(p['randomisation'])} randomisation; {before:+.2f} against patience {shorter_p}): "
                     f"{lead_change(before, after.delta('BLEU'))}")
    return f"{run} On test, {'; '.join(leads)}."


COMMAND = ("python experiments/multi30k_converged/driver.py report "
           "--pair experiments/multi30k_converged/en_fr.jsonl ../shared/data/multi30k_en_fr "
           "--pair experiments/multi30k_converged/en_de.jsonl ../shared/data/multi30k_en_de "
           "--out docs/results/multi30k_converged.md --plot docs/figures/multi30k_converged_bleu.png")


def render(pairs: List[Pair], plot_path: Optional[str] = None, page_path: Optional[str] = None) -> str:
    """The results page (markdown) of the pairs, with the tests cached beside their ledgers; the plot when asked
    (linked from the page relative to ``page_path``)."""
    tests = {pair.name: Tests(pair) for pair in pairs}
    attention_arms = [a for a in ATTENTION_ARMS if any(arm_keys(p, "attention", a) for p in pairs)]
    finetune_arms = [a for a in ("start", "tf", "soft_beam_paper", "softmax_k_times", *SWEEP[1:])
                     if any(arm_keys(p, "finetune", a) for p in pairs)]
    attention_lines, found_attention = comparison_table(pairs, tests, "attention", ATTENTION_COMPARISONS)
    finetune_lines, found_finetune = comparison_table(pairs, tests, "finetune", FINETUNE_COMPARISONS)
    sweep_lines = {p.name: sweep_summary(p, tests[p.name]) for p in pairs}
    sweep = next((line for line in sweep_lines.values() if line), None)
    tune_lines, found_tune = comparison_table(pairs, tests, "tune", TUNE_COMPARISONS)
    answers = summary(found_attention, found_finetune, pairs, sweep) + tune_summary(found_tune, pairs)
    tune_arms = [a for a in TUNE_ARMS if any(arm_keys(p, "tune", a) for p in pairs)]
    trained_arms = [a for a in tune_arms if a != "start"]  # (the starting checkpoints were not trained here)
    candidates = tune_candidates(pairs)
    curves = (os.path.join(os.path.dirname(plot_path), "multi30k_beam_training_curves.png")
              if plot_path and tune_arms and tune_curves(pairs, os.path.join(os.path.dirname(plot_path),
                                                                              "multi30k_beam_training_curves.png"))
              else None)
    fairness = [fairness_line(pair, found_attention) for pair in pairs]
    if plot_path:
        plot(pairs, tests, plot_path)
    n_tests = sum(t.count for t in tests.values())
    figure = os.path.relpath(plot_path, os.path.dirname(page_path)) if plot_path and page_path else None
    page = [
        "# Does top-k attention, or training through beam search, help a converged model?",
        "",
        "Multi30k (29,000 training pairs), models trained until early stopping, three seeds per main arm (one for "
        "the sweep and the patience check), each run's "
        "checkpoint chosen on val BLEU; scored with beam 5 and detokenised sacrebleu on val (1,014 sentences) and "
        "test_2016_flickr (1,000). Every difference below is *system - baseline* for models of the same seed; "
        "seeds are labelled s1, s2, s3.",
        "",
        "## Answers",
        "",
        *answers,
        "",
        "**Caveats.** One data set (two target languages, the same English sources), one model size (a 2+2-layer "
        "transformer with 128-dimensional embeddings for attention; for fine-tuning an RNNsearch with a 256-unit "
        "bidirectional GRU encoder and a 512-unit decoder), one k and one temperature (k 4, epsilon 0.1), "
        + (f"two fine-tuning settings (278 updates at Adam 1e-4; to convergence at one rate, {candidates})"
           if tune_arms else "one fine-tuning setting (278 updates at Adam 1e-4)") + ". The pooled "
        "tests ask whether a system is better on these test sentences across three training runs; with three "
        f"seeds the spread between runs is measured only roughly (the t-test column). This page reports {n_tests} "
        "p-values (per seed and pooled, BLEU and chrF, bootstrap and randomisation): at 0.05, a few of them are "
        "below it by chance alone. Every choice of the study (checkpoint, sweep) saw val; test_2016_flickr was "
        "scored for every run. Three further test sets (test_2017_flickr, test_2018_flickr, test_2017_mscoco; "
        "sources only) were translated by every en-de run and by the en-fr runs of the fine-tuning to convergence, "
        "the pre-trainings it started from and the softmax baseline with a longer patience -- the other en-fr "
        "runs' checkpoints were not kept, and they were not trained again for this -- and are scored outside "
        "the project: their hypotheses are in "
        "`experiments/multi30k_converged/*.blind/`, and nothing here reads them.",
        "",
        f"Reproduce this page: `{COMMAND}` (the tests are cached beside the ledgers; delete "
        "`experiments/multi30k_converged/*.tests.json` to recompute them, a few minutes).",
        "",
    ]
    if figure:
        page += [f"![Per-seed test BLEU of each attention arm with its 95% bootstrap interval]({figure})", ""]
    page += [
        "## Top-k attention",
        "",
        "A transformer trained from scratch with each arm's encoder-decoder attention weights (`--topk-attn-mode`; "
        "the perturbed arms are validated and scored with the hard top-k they smooth).",
        "",
        *arm_table(pairs, tests, "attention", attention_arms),
        "",
        *attention_lines,
        "",
        "### Epochs to convergence",
        "",
        "Validation every epoch; the learning rate halves on the second consecutive epoch without a val BLEU gain "
        "(`--lr-patience 1`: torch's plateau rule counts epochs without a gain and acts when the count exceeds the "
        "patience); training stops after 5 epochs without a gain (`--patience 5`; the fairness arm 10).",
        "",
        *convergence_table(pairs, "attention", attention_arms),
        "",
        stopping_check(pairs, "attention", attention_arms),
        "",
        "### Fairness check: the softmax baseline with a longer patience",
        "",
        "The softmax arm stops earlier than the top-k arms on some seeds. Legitimate under the rule, but it could "
        "favour the top-k arms; one seed per pair is therefore also trained with patience 10.",
        "",
        *fairness,
        "",
    ]
    if any(found_finetune):
        page += [
            "## Training through beam search (fine-tuning)",
            "",
            "From each seed's converged RNNsearch (the *starting checkpoint*; for seed 1 the re-trained one, whose "
            "checkpoint the fine-tunings started from), 2 epochs (278 updates) at a constant Adam 1e-4, "
            "validated every 50 updates, best on val: continued teacher forcing, soft beam search in the paper's "
            "setting (rho 0.8, beam 5, epsilon 0.1 with the paper's scaling, argmax bookkeeping, all candidates), "
            "and softmax-k-times at the same temperature.",
            "",
            *arm_table(pairs, tests, "finetune", finetune_arms),
            "",
            *finetune_lines,
            "",
        ]
        if sweep:
            page += [sweep, ""]
    if tune_arms or any(row["stage"] == "tune" for p in pairs for row in p.rows.values()):
        page += [
            "## Training through beam search, fine-tuned to convergence",
            "",
            "From each seed's converged RNNsearch (its *starting checkpoint*, named in each row), each arm restarts "
            "Adam at one rate under the pre-training's plateau schedule (x0.5 after an epoch without a val BLEU "
            "gain beyond the first) and stops after 5 epochs without a gain, validated every epoch, best on val: "
            "continued teacher forcing (the control), soft beam search in the paper's setting (rho 0.8, beam 5, "
            "epsilon 0.1 with the paper's scaling, argmax bookkeeping) and the same at rho 0.5, both with "
            f"{candidates}" + (" (the exact search costs 3x more; the pruning comparison below measures how "
                               "close their gradients are)" if candidates.endswith("per sentence") else "")
            + ". The rate, 1e-3 (the pre-training's own initial rate) or half of it, is "
            "chosen on one seed's control alone, by its val BLEU -- no soft beam-search result takes part in it:",
            "",
            *[f"- {tune_rate_line(pair)}" for pair in pairs if any(r["stage"] == "tune" for r in pair.rows.values())],
            "",
            *arm_table(pairs, tests, "tune", tune_arms),
            "",
            *tune_lines,
            "",
            *convergence_table(pairs, "tune", trained_arms),
            "",
            stopping_check(pairs, "tune", trained_arms),
            "",
            *([note, ""] if (note := selection_note(pairs, "tune", trained_arms)) else []),
        ]
        if curves and page_path:
            page += [f"![Val BLEU against updates of each fine-tuning to convergence, one line per seed, the start "
                     f"dashed]({os.path.relpath(curves, os.path.dirname(page_path))})", "",
                     "*Val BLEU (fairseq's, beam 5) at every epoch's end against updates, one panel per arm on one "
                     "scale, one line per seed; dashed: that seed's starting checkpoint as the tables score it.*", ""]
    page += [
        "## The pre-trainings",
        "",
        "The RNNsearch models the fine-tunings start from, trained to convergence with the same rule (teacher "
        "forcing, Adam 1e-3).",
        "",
        *convergence_table(pairs, "pretrain", ["teacher_forcing"]),
        "",
        *rerun_table(pairs),
        "",
        *pruning_section(pairs),
        "## Each seed's own tests",
        "",
        *per_seed_tests({"top-k attention": found_attention, "fine-tuning, 278 updates": found_finetune,
                         "fine-tuning to convergence": found_tune}),
        "",
        "## How these were obtained",
        "",
        "`experiments/multi30k_converged/driver.py run --data DIR` prepares the data (Moses punctuation "
        "normalisation, a joint sentencepiece BPE of 8,000 pieces), trains each arm with its one fairseq-train "
        "command line (CPU, 4,096 tokens per batch, Adam, label smoothing 0.1, validation BLEU with beam 5 every "
        "epoch), scores `checkpoint_best.pt` with `examples/wmt14_en_fr/evaluate.sh`, keeps the hypotheses beside "
        "the ledger and records the run in the ledger the moment it is scored; an interrupted run continues from "
        "its last checkpoint as an uninterrupted run would (the same learning-rate and early-stopping counts and "
        "the same batches: `reduce_lr_on_plateau_resumable`, "
        "`--update-epoch-batch-itr True`). The rows record the pair, the prepared data's fingerprint and the exact "
        "arguments. The paired tests are sacrebleu's (`significance.py`): paired bootstrap resampling (1,000 "
        "resamples) and approximate randomisation (10,000 trials), per seed and over the seeds' hypotheses "
        "concatenated (seed s of the system beside seed s of the baseline); chrF is chrF2. The t-test is a "
        "one-sample t-test of the per-seed BLEU differences.",
        "",
    ]
    for t in tests.values():
        t.save()
    return "\n".join(page)
