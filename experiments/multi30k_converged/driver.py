"""The converged Multi30k study: soft beam search and top-k attention against *converged* baselines.

    python experiments/multi30k_converged/driver.py run --data ../shared/data/multi30k_en_fr \\
        --workdir work/converged --ledger experiments/multi30k_converged/en_fr.jsonl \\
        [--stages pretrain finetune attention] [--seeds 1 2 3] [--blind DIR]
    python experiments/multi30k_converged/driver.py report \\
        --pair experiments/multi30k_converged/en_fr.jsonl ../shared/data/multi30k_en_fr \\
        --pair experiments/multi30k_converged/en_de.jsonl ../shared/data/multi30k_en_de \\
        --out docs/results/multi30k_converged.md --plot docs/figures/multi30k_converged_bleu.png
    python experiments/multi30k_converged/driver.py carry --workdir work/converged \
        --ledger experiments/multi30k_converged/en_fr.jsonl

Each language pair has its ledger here, ``experiments/multi30k_converged/en_TGT.jsonl`` (and its kept hypotheses
beside it, ``en_TGT.hyps/``), and its own workdir.

Any line-aligned English-X data works (``prepare.py`` is the WMT14 en-fr recipe's): ``--data DIR`` with
``DIR/train``, ``DIR/val`` and ``DIR/test_2016_flickr`` (``.en`` and one ``.TGT``, the target language, read from the
file names; ``--valid-name``/``--test-name`` for other names); each ledger row records its ``pair`` (``en-TGT``). One workdir and one ledger hold one data set: ``data/source.json`` records the inputs' sha256 when
they are prepared, each ledger row the prepared data's (``data_fingerprint``), and ``run`` stops, before it trains,
when ``--data`` or the ledger's rows disagree with the workdir.

Stages (each run is one fairseq-train command line, recorded in the ledger the moment it is scored; a run
already in the ledger is skipped, and an interrupted one continues from its own ``checkpoint_last.pt``):

* ``pretrain`` -- RNNsearch (the paper's model for soft beam search), teacher forcing, until converged:
  validation every epoch with BLEU (beam 5, fairseq's ``--eval-bleu``), Adam with a plateau schedule on that
  BLEU (x0.5 after ``--lr-patience`` epochs without a gain), early stopping after ``--patience`` epochs
  without a gain (fairseq's ``--patience``), at most ``--max-epoch`` epochs (a run that reaches it is recorded
  as not converged). Scored: ``checkpoint_best.pt``. The schedule is ``reduce_lr_on_plateau_resumable``
  (this package's): fairseq's own ``reduce_lr_on_plateau`` forgets, when a run continues from its checkpoint,
  the epochs without a gain counted so far and the halving due at the epoch the checkpoint closes, and
  ``--patience`` forgets its count -- so a run stopped and continued converged by a different rule than one
  that never stopped. And ``--update-epoch-batch-itr True``: fairseq composes an epoch's batches from the seed
  plus the epoch at which it builds its batch iterator, once per run unless told otherwise, so a continued run
  trained on other batches (same sizes, other sentences) from the restart on. With both, a continued run
  repeats an uninterrupted one exactly (tests/test_lr_schedulers.py). (The pre-trainings in the study's
  ledger had neither; seed 1's original was continued once -- where its curve leaves its rerun's.)
* ``finetune`` -- (after ``pruning``, whose comparison picks M: ``--candidates auto``, the smallest M whose
  gradient cosine to the exact gradient is >= 0.99 at the run's temperature, else exact) from each seed's
  converged checkpoint (``--finetune-from-model``: fresh optimizer and
  counters; on a resumed start fairseq continues the fine-tuning's own checkpoint instead) for
  ``--finetune-epochs`` epochs at Adam ``--finetune-lr`` (constant), validated (BLEU) every
  ``--finetune-validate-updates`` updates, best on val: continued teacher forcing, soft beam search in the
  paper's setting, softmax-k-times at that temperature, and soft beam search at the sweep's choice (``soft_beam_best``;
  any of ``FINETUNE_RUNS`` can be chosen with ``--runs``). A fine-tuning continued from a checkpoint of its first
  epoch repeats an uninterrupted one exactly; from one of its second epoch it trains the rest of that epoch on
  other batches (fairseq builds the batch iterator anew at the restart's epoch; see ``pretrain``), so stop these
  runs in their first epoch or let them finish.
* ``sweep`` -- (before ``finetune``) the fine-tunings of ``SWEEP`` on one seed (``--sweep-seed``): the paper's
  setting, distinct beams (``--soft-beam-bookkeeping topk``), and distinct beams with the temperature in nats; the
  one with the highest val BLEU is ``soft_beam_best``, which ``finetune`` then runs on every seed.
* ``tune`` -- fine-tunings *to convergence* from each seed's converged checkpoint (``--tune-runs``: continued teacher
  forcing, the control; soft beam search in the paper's setting, rho 0.8; the same at rho 0.5), each a restart of
  Adam at a rate of the pre-training's order under the pre-training's plateau schedule and early stopping
  (``--tune-patience`` epochs without a val BLEU gain, validated every epoch, at most ``--tune-max-epoch``), the
  soft ones with ``--tune-candidates`` candidates per sentence. The rate is chosen on the control alone: on the sweep
  seed, the control runs at every ``--tune-lrs`` rate, and the one with the highest val BLEU is every run's
  (``tune_lr_choice``); keys ``tune.NAME.lrLR.seedN``, each row with its ``start`` (the ledger key of the
  checkpoint it started from) and ``lr``.
* ``pruning`` -- on the first seed's converged checkpoint, M = 50 / 200 / exact compared on the same batches
  (``experiments/soft_beam_analysis/pruning.py``: L_SOFT, gradient cosine to the exact gradient, duplicate beams),
  one ledger entry.
* ``attention`` -- the transformer from scratch with softmax, SOFT top-k, hard top-k and perturbed top-k (16 and
  64 samples) encoder-decoder attention (``ATTENTION``; ``--attention-modes`` picks), with the pre-training's
  convergence rule.

Every scored run: ``evaluate.sh`` (beam 5, detokenised sacrebleu) on val and test, its hypotheses kept beside
the ledger (``LEDGER.hyps/KEY.SUBSET.TGT.gz``, written before the ledger row), so that ``report`` (``report.py``:
per-seed and pooled paired tests, BLEU and chrF, both pairs side by side) needs no workdir. Each scored run also
translates the blind test sets of ``--blind DIR`` (English sources whose references are held back) with the same
decoding, into ``LEDGER.blind/KEY.NAME.TGT.gz``, also before its ledger row; they are scored outside the study, and
nothing here reads them back. ``blind`` translates them for ledger runs whose checkpoints are in the workdir and
lack them. Ledger record: key, stage, arch, method, seed, updates, epochs, converged, the val BLEU curve, val/test
BLEU, wall seconds (``train_s``: the start that finished; ``train_s_starts``: each start's, from its log), the
commit of the code each start trained with (``code_starts``, from its log's first line), the exact extra arguments,
the pair and the prepared data's fingerprint.

A run longer than the machine it trains on is carried to the next: ``carry`` (the runs stopped first) keeps every
run in flight in the workdir beside the ledger (``LEDGER.carried/FOLDER/``: its last checkpoint with the optimizer's,
the schedule's and the data iterator's state, packed losslessly and in parts no git host refuses; its logs; and when
its best checkpoint is an earlier save, that checkpoint scored -- val and test hypotheses, BLEU, blind translations --
in its place, or for a pre-training, whose best the fine-tunings start from, its weights without the optimizer
state), and ``run`` in any workdir continues such a run from there as if it had not stopped, and removes it once the
run is recorded (the row's ``train_s_starts`` has a start per machine). Each carry adds a checkpoint's packed bytes to
the repository's history, and its removal as many again to that submission's diff: for runs that no single machine
can finish. ``background.sh`` runs the study this way on one machine: ``start`` (niced, from a snapshot of the
committed code, continuing whatever was stopped or carried), ``pause``/``resume``, and ``carry`` (stop, then carry).

Fine-tuning and pruning start from the pre-training's ``checkpoint_best.pt`` in the workdir, or from its copy
kept beside the ledger (``LEDGER.starts/KEY.pt``, without the optimizer state that a fine-tuning resets: a third
of the bytes), written with every pre-training's row, so that a new workdir fine-tunes without training again. When the ledger
has a pre-training whose workdir is gone, ``--retrain-missing`` trains it again from scratch into the same
place and records that run too, as ``KEY.rerun`` (then ``KEY.rerun2``, ... : a checkpoint folder is used only when
the file ``ledger_key`` in it names a recorded run, written as the run is recorded), which ``report`` sets beside the original (a rerun need not
reproduce it: seed 1's matched the original's recorded epochs before its restart to the digit and none after
it, as fairseq's restart built other batches -- see ``pretrain``); without the flag those
fine-tunings are skipped with a message saying so.
"""
import argparse
import datetime
import gzip
import hashlib
import itertools
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(HERE))  # experiments/: the ledger
sys.path.insert(0, HERE)  # the study's libraries (tuning; report, for its command)
from ledger import append_row, rows_by_key  # noqa: E402
from softtopk_fairseq.pipeline.run import quiet_warnings_env, run_logged  # noqa: E402
from tuning import TUNE_CONTROL, rate_seed, tune_key, tune_lr_choice  # noqa: E402

RECIPE = os.path.join(REPO_ROOT, "examples", "wmt14_en_fr")
PRUNING = os.path.join(REPO_ROOT, "experiments", "soft_beam_analysis", "pruning.py")
BEAM = 5

# Validation BLEU inside fairseq-train, as evaluate.sh scores it (beam 5, the same length limits).
EVAL_BLEU = ["--eval-bleu", "--eval-bleu-args", json.dumps({"beam": BEAM, "max_len_a": 1.5, "max_len_b": 10}),
             "--eval-bleu-remove-bpe", "sentencepiece", "--best-checkpoint-metric", "bleu",
             "--maximize-best-checkpoint-metric"]
COMMON = ["--cpu", "--max-tokens", "4096", "--batch-size", "256", "--num-workers", "0",
          "--required-batch-size-multiple", "1", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
          "--clip-norm", "1.0", "--no-epoch-checkpoints", "--save-interval-updates", "0",
          "--log-format", "simple", "--log-interval", "50", "--label-smoothing", "0.1"]
# glibc hands blocks over 32 MiB back to the kernel on free (mmap), so the exact soft beam search's ~100 MB step
# tensors page-fault afresh at every step: half the update's time is the kernel's (docs/results/training_cost.md).
# Kept in the heap instead, an exact update is 1.6x faster; the arithmetic is the same. A user's own setting wins.
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}
RNNSEARCH = ["--arch", "rnnsearch"]  # its defaults: 256-unit bi-GRU encoder, 512-unit GRU decoder, dropout 0.2
TRANSFORMER = ["--arch", "transformer_topk_attn", "--share-all-embeddings", "--encoder-layers", "2",
               "--decoder-layers", "2", "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
               "--encoder-ffn-embed-dim", "256", "--decoder-ffn-embed-dim", "256",
               "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--dropout", "0.1",
               "--topk-attn-k", "4", "--topk-attn-epsilon", "0.1"]
# Each arm's weights in training and in validation / scoring. The perturbed top-k (Berthet et al.) is random at
# every call, so it is validated and scored with the hard top-k it smooths (its sigma -> 0 limit), not with
# another noisy draw; the others with their own weights. ``perturbed_64``: the same with 64 perturbations per call
# instead of the default 16 -- a Monte-Carlo gradient with half the noise, which tests whether that noise is why
# the perturbed arm trains worse.
ATTENTION = {"softmax": ["--topk-attn-mode", "softmax", "--topk-attn-inference", "same"],
             "soft_topk": ["--topk-attn-mode", "soft_topk", "--topk-attn-inference", "same"],
             "hard_topk": ["--topk-attn-mode", "hard_topk", "--topk-attn-inference", "same"],
             "perturbed": ["--topk-attn-mode", "perturbed", "--topk-attn-inference", "hard_topk"],
             "perturbed_64": ["--topk-attn-mode", "perturbed", "--topk-attn-inference", "hard_topk",
                              "--topk-attn-samples", "64"]}
# The fairness check of the earlier-stopping baseline: softmax attention with a longer early-stopping patience.
ATTENTION["softmax_patience10"] = ATTENTION["softmax"]
# Arms whose early-stopping patience is not --patience.
PATIENCE = {"softmax_patience10": 10}
# (Ledger rows keep the arguments they were trained with: rows before the criterion's flags were renamed hold
# their old names -- --soft-topk-epsilon, --soft-topk-scaling, --soft-topk-method, --perturbed-sigma -- which
# fairseq still accepts.)
PAPER = ["--teacher-forcing-ratio", "0.8", "--teacher-forcing-mode", "sum", "--soft-beam-size", "5",
         "--soft-beam-epsilon", "0.1", "--soft-beam-scaling", "paper", "--soft-beam-bookkeeping", "argmax"]
FINETUNE_RUNS = {
    "tf": ["--teacher-forcing-ratio", "1.0"],  # the criterion at rho 1 is label_smoothed_cross_entropy exactly
    "soft_beam_paper": PAPER,
    "softmax_k_times": PAPER + ["--soft-beam-relaxation", "softmax_k_times"],
    "soft_beam_topk_bookkeeping": PAPER + ["--soft-beam-bookkeeping", "topk"],
    # the temperature in nats (no scaling) with distinct beams: the pruning comparison's second setting
    "soft_beam_nats": PAPER + ["--soft-beam-bookkeeping", "topk", "--soft-beam-scaling", "none",
                               "--soft-beam-epsilon", "1.0"],
    # the noise's sigma: --soft-beam-epsilon, 0.1 in PAPER
    "perturbed": PAPER + ["--soft-beam-relaxation", "perturbed"],
    # the paper's setting with as much weight on the soft beam search's loss as on teacher forcing (argparse: the
    # later --teacher-forcing-ratio wins)
    "soft_beam_rho05": PAPER + ["--teacher-forcing-ratio", "0.5"],
}
# The soft beam-search settings swept on one seed (--sweep-seed); ``soft_beam_best`` in --runs is the one of them
# with the highest val BLEU there (the earlier in this order on a tie), chosen on val only.
SWEEP = ["soft_beam_paper", "soft_beam_topk_bookkeeping", "soft_beam_nats"]
BEST = "soft_beam_best"
DEFAULT_FINETUNE = ["tf", "soft_beam_paper", "softmax_k_times", BEST]
# The fine-tuning to convergence (stage ``tune``): the control and soft beam search at rho 0.8 and 0.5, each
# restarted at a learning rate of the pre-training's order under its plateau schedule until val BLEU stops improving.
TUNE_RUNS = [TUNE_CONTROL, "soft_beam_paper", "soft_beam_rho05"]
# The pruning comparison's setting whose temperature each soft fine-tuning run shares (--candidates auto).
PRUNING_SETTING = {"soft_beam_paper": "paper", "softmax_k_times": "paper", "soft_beam_topk_bookkeeping": "paper",
                   "perturbed": "paper", "soft_beam_nats": "topk_nats", "soft_beam_rho05": "paper"}
# --candidates auto: the smallest M whose gradient is this close (cosine) to the exact one's in the pruning
# comparison; the exact problem (M = 0) when none is.
GRAD_COSINE_MIN = 0.99


def chosen_candidates(pruning_rows: List[dict], setting: str) -> Optional[int]:
    """M for a fine-tuning at ``setting`` from the pruning comparison's rows: the smallest measured M > 0 whose
    gradient cosine to the exact gradient is at least GRAD_COSINE_MIN, else 0 (exact); None if the setting was
    not measured."""
    rows = [r for r in pruning_rows if r["setting"] == setting]
    if not rows:
        return None
    good = sorted(r["candidates"] for r in rows if r["candidates"] and r["grad_cosine"] >= GRAD_COSINE_MIN)
    return good[0] if good else 0


def sweep_choice(rows: Dict[str, dict], seed: int) -> Optional[str]:
    """The SWEEP setting with the highest val BLEU among the fine-tunings of ``seed`` (the earlier in SWEEP on a
    tie); None until every SWEEP setting is in the ledger at that seed."""
    val = {name: rows[f"finetune.{name}.seed{seed}"]["bleu"]["valid"] for name in SWEEP
           if f"finetune.{name}.seed{seed}" in rows}
    if len(val) < len(SWEEP):
        return None
    return max(SWEEP, key=lambda name: (val[name], -SWEEP.index(name)))


RERUN = re.compile(r"\.rerun\d*$")  # the suffix of a rerun's key (rerun_keys)


def rerun_keys(key: str):
    """The ledger keys of a run trained again into its own folder (``--retrain-missing``), in order: ``KEY.rerun``,
    ``KEY.rerun2``, ``KEY.rerun3``, ..."""
    n = 1
    while True:
        yield f"{key}.rerun" + (str(n) if n > 1 else "")
        n += 1


# Written into a run's checkpoint folder once the run is recorded: the ledger key whose run the checkpoints are
# (a folder's checkpoints may be a rerun's, or a run in flight that the ledger does not have yet).
RECORDED_AS = "ledger_key"


def recorded_as(save: str) -> Optional[str]:
    """The ledger key of the finished run whose checkpoints ``save`` holds; None for a run not recorded."""
    path = os.path.join(save, RECORDED_AS)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def recorded_unmarked(save: str, rows: Dict[str, dict]) -> Optional[str]:
    """The ledger key of the run whose checkpoints (or carry) ``save`` holds when the ledger has its row but ``save``
    not its :data:`RECORDED_AS` (a stop between the two): the row of the folder's name or one of its reruns whose
    starts' seconds (``train_s_starts``) begin with those of the logs in ``save``; None when none does."""
    name = os.path.basename(os.path.normpath(save))
    starts = starts_seconds([TrainLog(os.path.join(save, f)) for f in train_logs(save)])
    if not starts:
        return None
    return next((key for key, row in rows.items()
                 if RERUN.sub("", key) == name and row.get("train_s_starts", [])[:len(starts)] == starts), None)


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# The files of data/bin a run reads: the dictionaries and the binarised splits. fairseq-preprocess writes its log
# there too (preprocess.log: its arguments, absolute paths included, appended to on every preparation), which is not
# data: fingerprinting it tied a ledger to the folder its workdir was prepared in.
DATA_FILE = re.compile(r"^dict\.[^/]+\.txt$|\.(bin|idx)$")


def prepared_fingerprint(data: str) -> str:
    """sha256 (16 hex digits) of the prepared data a run trains and is scored on: the dictionaries and binarised
    splits of ``data/bin`` (:data:`DATA_FILE`), names and contents -- the same wherever the workdir is; recorded in
    each ledger row as ``data_fingerprint``."""
    digest = hashlib.sha256()
    bin_dir = os.path.join(data, "bin")
    for name in sorted(os.listdir(bin_dir)):
        if DATA_FILE.search(name) and os.path.isfile(os.path.join(bin_dir, name)):
            digest.update(f"{name}\0{file_sha256(os.path.join(bin_dir, name))}\n".encode())
    return digest.hexdigest()[:16]


SRC = "en"


def target_language(data: str) -> str:
    """The target language of raw data ``data``: the one suffix of ``data/train.*`` besides the source's."""
    langs = sorted({name.split(".")[1] for name in os.listdir(data) if name.startswith("train.")
                    and len(name.split(".")) in (2, 3)} - {SRC}) if os.path.isdir(data) else []
    if len(langs) != 1:
        raise SystemExit(f"multi30k_converged: --data {data} should hold train.{SRC} and one train.TGT beside it "
                         f"(found targets: {', '.join(langs) or 'none'})")
    return langs[0]


def source_files(data: str, splits: List[str], tgt: str) -> Dict[str, Optional[str]]:
    """sha256 of each raw input ``data/SPLIT.LANG`` (or its ``.gz``, as ``prepare.py`` reads it); None if missing."""
    found = {}
    for split in splits:
        for lang in (SRC, tgt):
            path = os.path.join(data, f"{split}.{lang}")
            path = path if os.path.exists(path) or not os.path.exists(path + ".gz") else path + ".gz"
            found[os.path.basename(path)] = file_sha256(path) if os.path.isfile(path) else None
    return found


def prepared_target(data: str) -> str:
    """The target language of prepared data (``data/ref/valid.TGT``, the untouched references)."""
    refs = sorted(name.split(".")[1] for name in os.listdir(os.path.join(data, "ref"))
                  if name.startswith("valid.") and name != f"valid.{SRC}") if os.path.isdir(os.path.join(data, "ref")) else []
    if len(refs) != 1:
        raise SystemExit(f"multi30k_converged: {data}/ref should hold valid.{SRC} and one valid.TGT: prepare the data "
                         "with this driver")
    return refs[0]


def hyps_dir(ledger: str) -> str:
    """Where the scored runs' hypotheses are kept: beside the ledger (LEDGER minus .jsonl, plus .hyps)."""
    return re.sub(r"\.jsonl$", "", ledger) + ".hyps"


def starts_dir(ledger: str) -> str:
    """Where the pre-trainings' checkpoints are kept for the fine-tunings that start from them, in any workdir:
    beside the ledger (LEDGER minus .jsonl, plus .starts), ``KEY.pt``."""
    return re.sub(r"\.jsonl$", "", ledger) + ".starts"


def keep_start(checkpoint: str, path: str) -> None:
    """A fairseq checkpoint without its optimizer state (two thirds of its bytes), at ``path``: all that a
    fine-tuning started from it reads (``--finetune-from-model`` resets the optimizer, the schedule, the meters and
    the data iterator)."""
    import torch  # (only here: the rest of the driver runs without torch)

    state = torch.load(checkpoint, map_location="cpu", weights_only=False)  # fairseq's own format
    state["last_optimizer_state"] = None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def carried_dir(ledger: str) -> str:
    """Where the runs in flight are carried to another machine (``carry``): beside the ledger (LEDGER minus .jsonl,
    plus .carried), one folder per checkpoint folder, removed when its run is recorded."""
    return re.sub(r"\.jsonl$", "", ledger) + ".carried"


LAST, BEST_CHECKPOINT = "checkpoint_last.pt", "checkpoint_best.pt"
# The largest file a carry writes: a checkpoint with its optimizer state is kept as numbered parts, so that no file
# in the repository's history is larger than git hosts take in one file.
CARRY_PART_BYTES = 40 * 2**20
PART = re.compile(r"^(?P<name>.+)\.part(?P<index>\d{3})$")
# A carried checkpoint is packed: its bytes regrouped into four planes (byte 0 of every 4-byte word, then byte 1,
# ...) and deflated. A checkpoint is float32 tensors at 4-byte-aligned offsets (torch aligns each storage in its zip),
# whose sign-and-exponent bytes deflate well once they sit together, unlike the mantissas they alternate with in the
# file as it is. Lossless: unpacked, it is the same bytes.
PACKED = ".planes.zlib"
WORD = 4


def pack(data: bytes) -> bytes:
    """``data`` regrouped into :data:`WORD` byte planes (its tail past the last whole word kept last) and deflated."""
    whole = len(data) - len(data) % WORD
    return zlib.compress(b"".join(data[i:whole:WORD] for i in range(WORD)) + data[whole:], 9)


def unpack(packed: bytes) -> bytes:
    """The bytes that :func:`pack` packed."""
    planes = zlib.decompress(packed)
    whole = len(planes) - len(planes) % WORD
    data = bytearray(len(planes))
    for i in range(WORD):
        data[i:whole:WORD] = planes[i * whole // WORD:(i + 1) * whole // WORD]
    data[whole:] = planes[whole:]
    return bytes(data)


def write_in_parts(data: bytes, dest: str, part_bytes: int) -> None:
    """``data`` written to ``DEST.part000``, ``DEST.part001``, ... of at most ``part_bytes`` each."""
    for index in range(max(1, -(-len(data) // part_bytes))):
        with open(f"{dest}.part{index:03d}", "wb") as part:
            part.write(data[index * part_bytes:(index + 1) * part_bytes])


def write_packed(src: str, dest: str, part_bytes: int) -> None:
    """File ``src`` packed (:func:`pack`) and written in parts of at most ``part_bytes`` as ``DEST.planes.zlib.partNNN``
    (:func:`write_in_parts`)."""
    with open(src, "rb") as f:
        write_in_parts(pack(f.read()), dest + PACKED, part_bytes)


# fairseq-train's line for the checkpoint a start continues from (a fresh start has none)
LOADED = re.compile(r"Loaded checkpoint \S+ \(epoch \d+ @ (\d+) updates\)")


def train_logs(save: str) -> List[str]:
    """The fairseq-train logs of a checkpoint folder, one per start, oldest first: in order of the updates each start
    continued from (0 for a fresh start), then of their names (``train.<time>.log``), so that a run carried between
    machines does not rest on their clocks agreeing."""
    def continued_from(name: str) -> int:
        with open(os.path.join(save, name), encoding="utf-8") as f:
            for line in f:
                loaded = LOADED.search(line)
                if loaded or "begin training epoch" in line:  # (read up to its first epoch, not the whole log)
                    return int(loaded.group(1)) if loaded else 0
        return 0

    names = sorted(f for f in os.listdir(save) if f.startswith("train.") and f.endswith(".log"))
    return sorted(names, key=continued_from)  # (stable: the names' order among starts from the same checkpoint)


# The scores of a run's best checkpoint (``Study.score``): a folder in the checkpoint folder with scores.json (the
# checkpoint's updates and BLEU, and the paths of its hypotheses, which a carry without the checkpoint carries).
SCORED_BEST = "best_scored"
# The updates a carried run was carried at (a file in the carry): ``run`` restores a carry ahead of its workdir's run.
CARRIED_AT = "carried_at"


def copy_scores(scored: str, dest: str) -> None:
    """A best checkpoint's scores (:data:`SCORED_BEST` folder ``scored``) copied to ``dest``: scores.json and the
    hypotheses it names, nothing else that scoring left there (fairseq-generate's logs)."""
    with open(os.path.join(scored, "scores.json"), encoding="utf-8") as f:
        scores = json.load(f)
    for path in ["scores.json", *scores["hypotheses"].values(), *scores["blind"].values()]:
        os.makedirs(os.path.dirname(os.path.join(dest, path)), exist_ok=True)
        shutil.copyfile(os.path.join(scored, path), os.path.join(dest, path))


def carried_updates(carried: str) -> int:
    """The updates the run carried in ``carried`` was carried at (-1 for a carry of a version that did not say)."""
    path = os.path.join(carried, CARRIED_AT)
    if not os.path.exists(path):
        return -1
    with open(path, encoding="utf-8") as f:
        return int(f.read())


def repair_last(save: str) -> bool:
    """A ``checkpoint_last.pt`` cut short in checkpoint folder ``save`` replaced by the save it was being copied
    from: fairseq writes a new best save to checkpoint_best.pt (atomically: a temporary file renamed) and then copies
    it to checkpoint_last.pt (a plain copy), so a stop during that copy leaves the best whole and the last without
    its zip end record. Whether it replaced one; an error when the best is not whole either."""
    last, best = os.path.join(save, LAST), os.path.join(save, BEST_CHECKPOINT)
    if not os.path.exists(last) or zipfile.is_zipfile(last):
        return False
    if not (os.path.exists(best) and zipfile.is_zipfile(best)):
        raise SystemExit(f"multi30k_converged: {last} is cut short and there is no whole {BEST_CHECKPOINT} beside "
                         f"it; the run cannot be continued: remove {save} to train it from scratch")
    print(f"{save}: {LAST} is cut short (stopped while fairseq copied its best save to it): replaced by "
          f"{BEST_CHECKPOINT}", flush=True)
    shutil.copyfile(best, last + ".partial")
    os.replace(last + ".partial", last)
    return True


def carry_run(save: str, dest: str, part_bytes: int = CARRY_PART_BYTES, score_best=None) -> int:
    """The run in flight in checkpoint folder ``save``, copied to ``dest``: its ``checkpoint_last.pt`` (the
    optimizer's, the schedule's and the data iterator's state with the weights: ``run`` continues it as if it had
    not stopped) packed (:func:`pack`) in parts of at most ``part_bytes``, and its train logs (the row's curve and
    times). Its best checkpoint, when it is an earlier save than the last, is carried as what the run's record reads
    of it: ``score_best(checkpoint, folder)`` scores it into ``dest/best_scored`` (:data:`SCORED_BEST`); with
    ``score_best`` None (a pre-training: the fine-tunings start from its weights), its weights without the optimizer
    state, packed. A run carried before keeps the scores it carried. Written beside ``dest`` and then moved into
    place, so that a carry cut short leaves the previous one. Returns the updates it was carried at."""
    repair_last(save)
    updates = checkpoint_updates(os.path.join(save, LAST))
    partial = dest + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    write_packed(os.path.join(save, LAST), os.path.join(partial, LAST), part_bytes)
    best = os.path.join(save, BEST_CHECKPOINT)
    if os.path.exists(best) and checkpoint_updates(best) != updates:
        if score_best is not None:
            score_best(best, os.path.join(save, SCORED_BEST))
            copy_scores(os.path.join(save, SCORED_BEST), os.path.join(partial, SCORED_BEST))
        else:
            stripped = os.path.join(partial, BEST_CHECKPOINT)
            keep_start(best, stripped)
            write_packed(stripped, stripped, part_bytes)
            os.remove(stripped)
    elif not os.path.exists(best) and os.path.isdir(os.path.join(save, SCORED_BEST)):
        copy_scores(os.path.join(save, SCORED_BEST), os.path.join(partial, SCORED_BEST))
    for log in train_logs(save):
        shutil.copyfile(os.path.join(save, log), os.path.join(partial, log))
    with open(os.path.join(partial, CARRIED_AT), "w", encoding="utf-8") as f:
        f.write(f"{updates}\n")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(partial, dest)
    return updates


def carry_ahead(carried: str, save: str) -> bool:
    """Whether the run carried in ``carried`` is to be restored into checkpoint folder ``save``: there is one, and the
    folder's own run is not as far (no checkpoint_last.pt, or one of fewer updates: this workdir's copy stopped
    before a machine that continued the run carried it)."""
    if not os.path.isdir(carried):
        return False
    last = os.path.join(save, LAST)
    return not os.path.exists(last) or checkpoint_updates(last) < carried_updates(carried)


def restore_carried(carried: str, save: str) -> None:
    """A run carried by :func:`carry_run` put back into its checkpoint folder ``save``: each checkpoint joined from
    its parts and unpacked, its best checkpoint a copy of the last when it was the same save, or the scores carried
    in its place. What ``save`` held is removed first (a run that stopped before its first checkpoint, or one behind
    the carry)."""
    shutil.rmtree(save, ignore_errors=True)
    os.makedirs(save)
    parts: Dict[str, List[str]] = {}
    for name in sorted(os.listdir(carried)):  # a checkpoint's parts in order
        part = PART.match(name)
        if part:
            parts.setdefault(part["name"], []).append(name)
        elif name == SCORED_BEST:
            shutil.copytree(os.path.join(carried, name), os.path.join(save, name))
        elif name != CARRIED_AT:
            shutil.copyfile(os.path.join(carried, name), os.path.join(save, name))
    for stored, names in parts.items():
        data = b"".join(open(os.path.join(carried, name), "rb").read() for name in names)
        packed = stored.endswith(PACKED)  # (a carry of an earlier version kept its checkpoints as they are)
        target = os.path.join(save, stored[:-len(PACKED)] if packed else stored)
        with open(target + ".tmp", "wb") as out:
            out.write(unpack(data) if packed else data)
        os.replace(target + ".tmp", target)
    if not {BEST_CHECKPOINT, BEST_CHECKPOINT + PACKED} & set(parts) and SCORED_BEST not in os.listdir(carried):
        shutil.copyfile(os.path.join(save, LAST), os.path.join(save, BEST_CHECKPOINT))


def blind_dir(ledger: str) -> str:
    """Where the blind test sets' hypotheses go: beside the ledger (LEDGER minus .jsonl, plus .blind). Written for
    scoring outside the project: nothing here reads them."""
    return re.sub(r"\.jsonl$", "", ledger) + ".blind"


def gzip_file(path: str, gz: str) -> None:
    """``path`` gzipped into ``gz`` (no timestamp, so that the same hypotheses give the same bytes)."""
    os.makedirs(os.path.dirname(gz), exist_ok=True)
    with open(path, "rb") as f, gzip.GzipFile(gz, "wb", mtime=0) as g:
        g.write(f.read())


def keep_hypotheses(ledger: str, key: str, hypotheses: Dict[str, str], tgt: str) -> None:
    """Copies a scored run's detokenised hypotheses (their paths by subset: val and test) beside the ledger,
    gzipped."""
    for subset, path in hypotheses.items():
        gzip_file(path, os.path.join(hyps_dir(ledger), f"{key}.{subset}.{tgt}.gz"))


def blind_sets(blind: Optional[str]) -> Dict[str, str]:
    """The blind test sources of ``--blind DIR`` (``NAME.en``: English without references), by NAME."""
    if not blind or not os.path.isdir(blind):
        return {}
    return {name[:-len(f".{SRC}")]: os.path.join(blind, name) for name in sorted(os.listdir(blind))
            if name.endswith(f".{SRC}")}


# The commit of the code a run trains with: a snapshot without git history (background.sh's) holds it in this file.
COMMIT_FILE = "COMMIT"


def code_commit(root: str = REPO_ROOT) -> Optional[str]:
    """The commit of the code in ``root``: its :data:`COMMIT_FILE`, else git's HEAD, with ``+uncommitted`` when a
    tracked file differs from it; None when neither tells."""
    if os.path.exists(os.path.join(root, COMMIT_FILE)):
        with open(os.path.join(root, COMMIT_FILE), encoding="utf-8") as f:
            return f.read().strip() or None
    git = lambda *args: subprocess.run(["git", "-C", root, *args], capture_output=True, text=True)
    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return None
    changed = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + ("+uncommitted" if changed else "")


class TrainLog:
    """What the driver reads from one fairseq-train log (one start of a run), in one pass: the commit of the code
    it trained with (its first line, :data:`CODE_LINE`; None for a log without it), every validation's (epoch,
    updates, val BLEU), the update counts at which a checkpoint was saved, whether fairseq stopped early, and the
    seconds from its first to its last timestamped line (pauses included)."""

    TIMESTAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) \|")
    CODE_LINE = "code: {}\n"

    def __init__(self, log_path: str):
        self.curve: List[dict] = []
        self.saved: List[int] = []
        self.stopped_early = False
        first = last = None  # the first and last timestamps
        with open(log_path, encoding="utf-8") as f:
            code = re.fullmatch(self.CODE_LINE.format(r"(\S+)"), f.readline())
            self.code: Optional[str] = code and code.group(1)
            f.seek(0)
            for line in f:
                stamp = self.TIMESTAMP.match(line)
                if stamp:
                    first, last = first or stamp.group(1), stamp.group(1)
                if "valid on 'valid' subset" in line:
                    fields = dict(re.findall(r"\| (\w+) ([-\d.e+]+)", line))
                    if "bleu" in fields:
                        self.curve.append({"epoch": int(re.search(r"epoch (\d+)", line).group(1)),
                                           "updates": int(fields["num_updates"]), "bleu": float(fields["bleu"])})
                self.saved += [int(u) for u in re.findall(r"Saved checkpoint \S+ \(epoch \d+ @ (\d+) updates", line)]
                self.stopped_early |= "early stop since valid performance hasn't improved" in line
        parse = lambda stamp: datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S")
        self.seconds = (parse(last) - parse(first)).total_seconds() if first else 0.0


def starts_seconds(logs: List[TrainLog]) -> List[float]:
    """A run's ``train_s_starts``: each start's seconds (``logs``, oldest first), as the row records them."""
    return [round(t.seconds, 1) for t in logs]


def run_curve(logs: List[TrainLog]) -> List[dict]:
    """A run's validations across its starts (``logs``, oldest first), in order of updates; one that a restart
    repeated -- its start stopped after validating but before saving that checkpoint -- counted once, as the
    restart's (whose training the run continued)."""
    at = {}
    for log in logs:
        at.update((point["updates"], point) for point in log.curve)
    return [at[updates] for updates in sorted(at)]


def best_validation(curve: List[dict]) -> Optional[dict]:
    """The validation fairseq keeps as ``checkpoint_best.pt`` when every validation is saved: the highest BLEU,
    the *last* of equal ones (fairseq's ``is_better`` is ``>=`` for a maximised metric)."""
    best = None
    for point in curve:
        if best is None or point["bleu"] >= best["bleu"]:
            best = point
    return best


def checkpoint_updates(path: str) -> int:
    """The number of updates a fairseq checkpoint was saved at."""
    import torch  # (only here: the rest of the driver runs without torch)

    state = torch.load(path, map_location="cpu", weights_only=False)  # fairseq's own format: configs, not weights only
    return int(state["optimizer_history"][-1]["num_updates"])


def translate_blind(data: str, checkpoint: str, names: List[str], out: str) -> Dict[str, str]:
    """The blind sets ``names`` (prepared by ``prepare.py --sources-only`` into ``data/sources/NAME``) translated
    with the scoring's decoding (``translate.sh``: beam 5, the same length limits, detokenised); their paths."""
    paths = {}
    os.makedirs(out, exist_ok=True)
    for name in names:
        env = dict(os.environ, PYTHON=sys.executable, SUBSET="test", BEAM=str(BEAM), OUT=os.path.join(out, name),
                   BIN=os.path.join(data, "sources", name, "bin"))
        log = os.path.join(out, f"translate.{name}.log")
        paths[name] = run_logged(["bash", os.path.join(RECIPE, "translate.sh"), data, checkpoint], log, env=env,
                                 echo=False).strip().splitlines()[-1]
    return paths


def evaluate(data: str, checkpoint: str, out: str) -> Dict[str, float]:
    """evaluate.sh (beam 5, sacrebleu) on valid and test; hypotheses stay in ``out`` for the paired bootstrap."""
    bleu = {}
    for subset in ("valid", "test"):
        env = dict(os.environ, PYTHON=sys.executable, SUBSET=subset, BEAM=str(BEAM), OUT=out)
        run_logged(["bash", os.path.join(RECIPE, "evaluate.sh"), data, checkpoint],
                   os.path.join(out, f"evaluate.{subset}.log"), env=env, echo=False)
        with open(os.path.join(out, f"{subset}.beam{BEAM}.bleu"), encoding="utf-8") as f:
            bleu[subset] = float(f.read())
    return bleu


class Study:
    def __init__(self, args):
        self.args = args
        self.ledger = args.ledger or os.path.join(args.workdir, "ledger.jsonl")
        self.data = args.prepared or os.path.join(args.workdir, "data")
        self.tgt = target_language(args.data) if not args.prepared else prepared_target(self.data)
        self.blind = blind_sets(args.blind)

    def prepare(self) -> None:
        """Prepares ``--data`` into WORKDIR/data once, recording its inputs' sha256 in ``data/source.json``; a
        later ``run`` on a workdir prepared from other inputs stops before touching anything."""
        a = self.args
        prepared = os.path.exists(os.path.join(self.data, "bin", f"dict.{self.tgt}.txt"))
        if a.prepared:  # another workdir's prepared data, checked against its inputs when that workdir ran
            if not prepared:
                raise SystemExit(f"multi30k_converged: --prepared {a.prepared} has no bin/dict.{self.tgt}.txt: give "
                                 "the data/ folder of a workdir this driver prepared")
            return
        splits = ["train", a.valid_name, a.test_name]
        inputs = source_files(a.data, splits, self.tgt)
        missing = [name for name, sha in inputs.items() if sha is None]
        if missing:
            raise SystemExit(f"multi30k_converged: --data {a.data} lacks {', '.join(missing)} (line-aligned "
                             f"{SRC}-{self.tgt} text: {', '.join(f'{s}.{SRC}/.{self.tgt}' for s in splits)}; "
                             "--valid-name/--test-name for other names)")
        source = os.path.join(self.data, "source.json")
        if prepared and os.path.exists(source):
            with open(source, encoding="utf-8") as f:
                recorded = json.load(f)
            differ = sorted(n for n in set(inputs) | set(recorded["files"])
                            if inputs.get(n) != recorded["files"].get(n))
            if differ:
                raise SystemExit(f"multi30k_converged: {self.data} was prepared from {recorded['data']}, and --data "
                                 f"{a.data} differs ({', '.join(differ)}): its runs would train on the old data. Use a "
                                 "new --workdir (and --ledger) for this data, or the original --data")
            return
        if prepared:  # prepared by a version that did not record its inputs: recorded from now on
            print(f"multi30k_converged: {source} missing (prepared by an earlier version); recording --data "
                  f"{a.data} as its inputs", flush=True)
        else:
            os.makedirs(a.workdir, exist_ok=True)
            run_logged([sys.executable, os.path.join(RECIPE, "prepare.py"), "--dest", self.data,
                        "--train", f"{a.data}/train", "--valid", f"{a.data}/{a.valid_name}",
                        "--test", f"{a.data}/{a.test_name}", "--tgt", self.tgt, "--bpe", "sentencepiece", "--bpe-size",
                        str(a.bpe_size), "--workers", "2"], os.path.join(a.workdir, "prepare.log"))
        with open(source, "w", encoding="utf-8") as f:
            json.dump({"data": os.path.abspath(a.data), "files": inputs}, f, indent=1, sort_keys=True)

    def prepare_blind(self) -> None:
        """The blind sets' sources, encoded with this workdir's sentencepiece model and dictionaries
        (``prepare.py --sources-only``), once per workdir and whenever a source file changes; their sha256 in
        ``data/sources/source.json``."""
        if not self.blind:
            return
        record = os.path.join(self.data, "sources", "source.json")
        inputs = {name: file_sha256(path) for name, path in self.blind.items()}
        if os.path.exists(record):
            with open(record, encoding="utf-8") as f:
                if json.load(f) == inputs:
                    return
        run_logged([sys.executable, os.path.join(RECIPE, "prepare.py"), "--dest", self.data, "--bpe", "sentencepiece",
                    "--sources-only", *(f"{name}={path}" for name, path in self.blind.items())],
                   os.path.join(self.args.workdir, "prepare_blind.log"))
        with open(record, "w", encoding="utf-8") as f:
            json.dump(inputs, f, indent=1, sort_keys=True)

    def keep_blind(self, key: str, translations: Dict[str, str]) -> None:
        """A final model's translations of the blind sets (by name, :func:`translate_blind`), gzipped beside the
        ledger as ``KEY.NAME.TGT.gz``."""
        for name, path in translations.items():
            gzip_file(path, os.path.join(blind_dir(self.ledger), f"{key}.{name}.{self.tgt}.gz"))

    def score(self, checkpoint: str, out: str) -> dict:
        """What a run's record reads of its best checkpoint, made in folder ``out``: the hypotheses and BLEU of
        :func:`evaluate`, the blind sets' translations (:func:`translate_blind`), and ``out/scores.json`` (the
        checkpoint's updates, its BLEU, the hypotheses' and translations' paths relative to ``out``: all that
        :func:`carry_run` carries), which it returns."""
        os.makedirs(out, exist_ok=True)
        blind = translate_blind(self.data, checkpoint, list(self.blind), os.path.join(out, "blind"))
        scores = {"updates": checkpoint_updates(checkpoint), "bleu": evaluate(self.data, checkpoint, out),
                  "hypotheses": {subset: f"{subset}.beam{BEAM}.{self.tgt}" for subset in ("valid", "test")},
                  "blind": {name: os.path.relpath(path, out) for name, path in blind.items()}}
        with open(os.path.join(out, "scores.json"), "w", encoding="utf-8") as f:
            json.dump(scores, f, indent=1, sort_keys=True)
        return scores
    def check_ledger(self) -> None:
        """The ledger's runs were trained on this workdir's prepared data (rows record ``data_fingerprint``): one
        ledger, one data set. Rows without it are not checked: rows of versions before the fingerprint, and rows
        with only ``data_sha256``, the first version's, whose hash took in fairseq-preprocess's log (the workdir's
        paths) and cannot be recomputed from the data -- named once, so that a user knows what was not checked."""
        rows = rows_by_key(self.ledger)
        others = sorted(key for key, row in rows.items()
                        if row.get("data_fingerprint", self.data_fingerprint) != self.data_fingerprint)
        if others:
            raise SystemExit(f"multi30k_converged: the ledger {self.ledger} has runs on other prepared data than "
                             f"{self.data} (data_fingerprint {self.data_fingerprint}): {', '.join(others[:5])}"
                             f"{' ...' if len(others) > 5 else ''}. Give this data its own --ledger")
        legacy = sorted(key for key, row in rows.items() if "data_sha256" in row and "data_fingerprint" not in row)
        if legacy:
            print(f"multi30k_converged: not checked against {self.data}: {', '.join(legacy)} (they record only the "
                  "first version's data_sha256, which hashed fairseq-preprocess's log with the data)", flush=True)

    def record(self, row: dict) -> None:
        append_row(self.ledger, {**row, "pair": f"{SRC}-{self.tgt}", "data_fingerprint": self.data_fingerprint})

    def converge_args(self, patience: Optional[int] = None, max_epoch: Optional[int] = None) -> List[str]:
        """The convergence rule; ``patience``, ``max_epoch``: a run's own, when they differ from ``--patience``
        and ``--max-epoch``."""
        a = self.args
        # Exactly resumable: the plateau's and --patience's counts survive a restart (reduce_lr_on_plateau_resumable),
        # and each epoch's batches are built from seed + epoch whether or not the run restarted (fairseq otherwise
        # reuses epoch 1's in an uninterrupted run and builds new ones at the restart's epoch).
        return ["--update-epoch-batch-itr", "True",
                *EVAL_BLEU, "--lr-scheduler", "reduce_lr_on_plateau_resumable", "--lr-shrink", "0.5",
                "--lr-patience", str(a.lr_patience), "--patience", str(patience or a.patience), "--max-epoch", str(max_epoch or a.max_epoch)]

    def train_args(self, save: str, extra: List[str], seed: int) -> List[str]:
        """A run's fairseq-train arguments: the data, the plugin, ``save``, ``COMMON``, the run's ``extra``, the
        seed and ``--extra-args``."""
        return [os.path.join(self.data, "bin"), "--user-dir", os.path.join(REPO_ROOT, "user_dir"), "--save-dir", save,
                *COMMON, *extra, "--seed", str(seed), *shlex.split(self.args.extra_args)]

    def train(self, key: str, stage: str, arch: str, method: str, seed: int, extra: List[str],
              save_as: Optional[str] = None, fields: Optional[dict] = None) -> Optional[dict]:
        """One fairseq-train run and its scores, recorded; skipped when the ledger has it. ``save_as``: the
        checkpoint directory's name when it is not ``key`` (a rerun trains into its original's); ``fields``: more
        of the ledger row."""
        done = rows_by_key(self.ledger)
        save = os.path.join(self.args.workdir, "checkpoints", save_as or key)
        carried = os.path.join(carried_dir(self.ledger), save_as or key)
        if key in done:
            print(f"{key}: in the ledger, skipped", flush=True)
            # stopped between its row and removing its carry (a rerun's carry, in its original's name, may be a
            # later rerun's: removed when its logs are this run's)
            if os.path.isdir(carried) and (save_as is None or recorded_unmarked(carried, {key: done[key]}) == key):
                print(f"{key}: removing its carry {carried}", flush=True)
                shutil.rmtree(carried)
            return done[key]
        held = recorded_as(save)
        if held is not None and held != key and held in done:
            # A recorded run's leftovers without its best checkpoint (why pretrained() trains a rerun into its
            # original's folder): continued, they would be that run's training, or its early stop, again.
            print(f"{key}: {save} holds what is left of {held}, recorded; training {key} from scratch", flush=True)
            shutil.rmtree(save)
        if carry_ahead(carried, save):
            print(f"{key}: restoring the run carried in {carried}", flush=True)
            restore_carried(carried, save)
        os.makedirs(save, exist_ok=True)
        repair_last(save)
        resumed = os.path.exists(os.path.join(save, LAST))
        if resumed:
            print(f"{key}: continuing from {save}/{LAST}", flush=True)
        earlier = train_logs(save) if resumed else []
        start = time.time()
        if earlier and TrainLog(os.path.join(save, earlier[-1])).stopped_early:
            # It stopped by its rule and was stopped (or carried) before it was recorded: fairseq started again
            # would train an epoch before it checks the rule again. (A run that ended at --max-epoch continues if
            # that was raised, or trains nothing.)
            print(f"{key}: stopped early ({earlier[-1]}); recording it", flush=True)
        else:
            log = os.path.join(save, f"train.{int(time.time())}.log")  # one log per start: a resumed run keeps all
            cmd = [sys.executable, "-m", "fairseq_cli.train", *self.train_args(save, extra, seed)]
            # fairseq's own deprecation warnings filtered (quiet_warnings_env), every other warning kept in the log
            commit = code_commit()
            run_logged(cmd, log, env={**MALLOC_ENV, **quiet_warnings_env()}, echo=self.args.verbose,
                       header=TrainLog.CODE_LINE.format(commit) if commit else "")
        seconds = time.time() - start
        logs = [TrainLog(os.path.join(save, f)) for f in train_logs(save)]
        curve = run_curve(logs)
        best = best_validation(curve)
        # the best checkpoint scored; a run carried without it (carry_run) has the scores it carried instead
        scored_dir = os.path.join(save, SCORED_BEST)
        if os.path.exists(os.path.join(save, BEST_CHECKPOINT)):
            scores = self.score(os.path.join(save, BEST_CHECKPOINT), scored_dir)
        else:
            with open(os.path.join(scored_dir, "scores.json"), encoding="utf-8") as f:
                scores = json.load(f)
            print(f"{key}: scored at update {scores['updates']} before it was carried (no later gain)", flush=True)
        scored = scores["updates"]
        # checkpoint_best is the best of the *saved* checkpoints: the selection rule holds when every validation
        # was saved (said loudly, and kept in the row, when not)
        saved = {u for t in logs for u in t.saved}
        unsaved = [p["updates"] for p in curve if p["updates"] not in saved]
        if unsaved or (best and scored != best["updates"]):
            print(f"{key}: WARNING checkpoint_best.pt is from update {scored}, the best validation (BLEU "
                  f"{best and best['bleu']}) at update {best and best['updates']}; validations not saved at updates "
                  f"{unsaved}", flush=True)
        row = {"key": key, "stage": stage, "arch": arch, "method": method, "seed": seed,
               "updates": curve[-1]["updates"] if curve else None, "epochs": curve[-1]["epoch"] if curve else None,
               "best_updates": best and best["updates"], "scored_updates": scored, "unsaved_validations": unsaved,
               "converged": logs[-1].stopped_early if stage != "finetune" else None, **(fields or {}),
               # the CPU threads it trained with (torch's reductions split by it: the last bits depend on it)
               "threads": int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count()),
               # wall seconds of this start only; "resumed": an interrupted earlier start also trained (its log
               # is kept beside this one's); "train_s_starts": every start's first-to-last log line, pauses included
               "val_curve": curve, "train_s": round(seconds, 1), "resumed": resumed,
               "train_s_starts": starts_seconds(logs),
               # the commit each start trained with (None: a start whose log predates recording it)
               "code_starts": [t.code for t in logs],
               "bleu": scores["bleu"], "extra": extra + shlex.split(self.args.extra_args)}
        keep_hypotheses(self.ledger, key, {subset: os.path.join(scored_dir, path)
                                           for subset, path in scores["hypotheses"].items()}, self.tgt)
        self.keep_blind(key, {name: os.path.join(scored_dir, path) for name, path in scores["blind"].items()})
        if stage in ("pretrain", "rerun"):
            keep_start(os.path.join(save, "checkpoint_best.pt"), os.path.join(starts_dir(self.ledger), f"{key}.pt"))
        self.record(row)
        with open(os.path.join(save, RECORDED_AS), "w", encoding="utf-8") as f:
            f.write(key + "\n")
        shutil.rmtree(carried, ignore_errors=True)
        return row

    def pruning(self, seed: int) -> None:
        """On the converged checkpoint of ``seed``, M = 50 / 200 / exact for the paper's setting and topk
        bookkeeping in nats (:data:`PRUNING`), the rows recorded as one ledger entry."""
        key = f"pruning.rnnsearch.seed{seed}"
        if key in rows_by_key(self.ledger):
            print(f"{key}: in the ledger, skipped", flush=True)
            return
        start = self.pretrained(seed)
        if start is None:
            return
        out = os.path.join(self.args.workdir, f"{key}.jsonl")
        if os.path.exists(out):
            os.remove(out)  # a half-written earlier attempt
        run_logged([sys.executable, PRUNING, start,
                    os.path.join(self.data, "bin"), "--batches", str(self.args.pruning_batches), "--json", out],
                   os.path.join(self.args.workdir, f"{key}.log"))
        with open(out, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        self.record({"key": key, "stage": "pruning", "arch": "rnnsearch", "method": "pruning", "seed": seed,
                     "rows": rows})

    def candidates(self, run: str) -> Optional[int]:
        """--soft-beam-candidates of fine-tuning ``run``: --candidates, or with ``auto`` the pruning comparison's
        choice (chosen_candidates) for the run's temperature; None (said why) when there is none yet."""
        if self.args.candidates != "auto":
            return int(self.args.candidates)
        if run not in PRUNING_SETTING:  # teacher forcing: no beam search, M unused
            return 0
        pruning = [r for r in rows_by_key(self.ledger).values() if r["stage"] == "pruning"]
        m = chosen_candidates(pruning[0]["rows"], PRUNING_SETTING[run]) if pruning else None
        if m is None:
            print(f"finetune {run}: --candidates auto needs the pruning comparison at setting "
                  f"{PRUNING_SETTING[run]!r} in the ledger (run --stages pruning first, or give --candidates M), "
                  "skipped", flush=True)
        return m

    @property
    def sweep_seed(self) -> int:
        """The seed the sweep fine-tunes and ``soft_beam_best`` is chosen on: --sweep-seed, else the first seed."""
        return self.args.sweep_seed if self.args.sweep_seed is not None else self.args.seeds[0]

    def run_name(self, name: str) -> Optional[str]:
        """A --runs entry as a FINETUNE_RUNS name: ``soft_beam_best`` is the sweep's choice (None, said why,
        before the sweep is complete)."""
        if name != BEST:
            return name
        seed = self.sweep_seed
        chosen = sweep_choice(rows_by_key(self.ledger), seed)
        if chosen is None:
            print(f"finetune {BEST}: the sweep ({', '.join(SWEEP)}) is not complete at seed {seed} in the ledger "
                  "(run --stages sweep first), skipped", flush=True)
        else:
            print(f"finetune {BEST}: {chosen} (the sweep's best val BLEU at seed {seed})", flush=True)
        return chosen

    def finetune(self, seed: int, names: List[str]) -> None:
        """The fine-tunings ``names`` (FINETUNE_RUNS) from the converged checkpoint of ``seed``, those not in the
        ledger yet: equal budget, optimizer and schedule; scored at the best validation."""
        a = self.args
        done = rows_by_key(self.ledger)
        names = list(dict.fromkeys(names))  # (soft_beam_best may be one of the others)
        for name in names:
            if f"finetune.{name}.seed{seed}" in done:
                print(f"finetune.{name}.seed{seed}: in the ledger, skipped", flush=True)
        todo = [name for name in names if f"finetune.{name}.seed{seed}" not in done]
        start = self.pretrained(seed) if todo else None  # (which may train it again: --retrain-missing)
        if start is None:
            return
        for name in todo:
            m = self.candidates(name)
            if m is None:
                continue
            extra = RNNSEARCH + ["--finetune-from-model", start, "--criterion", "soft_beam_search",
                                 "--soft-beam-candidates", str(m), *FINETUNE_RUNS[name], *EVAL_BLEU,
                                 "--lr", str(a.finetune_lr), "--lr-scheduler", "fixed",
                                 "--max-epoch", str(a.finetune_epochs),
                                 "--validate-interval-updates", str(a.finetune_validate_updates),
                                 # a checkpoint at every validation, so that checkpoint_best is the best of all of
                                 # them (fairseq keeps the best only among saved ones)
                                 "--save-interval-updates", str(a.finetune_validate_updates),
                                 "--keep-interval-updates", "1"]
            self.train(f"finetune.{name}.seed{seed}", "finetune", "rnnsearch", name, seed, extra)

    def pretrain(self, seed: int, key: Optional[str] = None) -> None:
        """The converged RNNsearch pre-training of ``seed`` (recorded as ``key``, default its own key)."""
        own = f"pretrain.rnnsearch.seed{seed}"
        self.train(key or own, "pretrain" if key is None else "rerun", "rnnsearch", "teacher_forcing", seed,
                   RNNSEARCH + ["--lr", str(self.args.lr)] + self.converge_args()
                   + ["--criterion", "label_smoothed_cross_entropy"], save_as=own)

    def pretrained(self, seed: int) -> Optional[str]:
        """The converged checkpoint of ``seed``: the workdir's when it is a recorded pre-training or rerun of that
        seed (:data:`RECORDED_AS`); else the newest recorded one's kept beside the ledger (:func:`starts_dir`); else,
        with ``--retrain-missing``, trained again (or an interrupted retraining
        continued) as the next of :func:`rerun_keys`; None (said why) when there is none."""
        key = f"pretrain.rnnsearch.seed{seed}"
        save = os.path.join(self.args.workdir, "checkpoints", key)
        path = os.path.join(save, "checkpoint_best.pt")
        rows = rows_by_key(self.ledger)
        if os.path.exists(path) and recorded_as(save) in rows:
            return path
        if key not in rows:
            print(f"seed {seed}: no converged pre-training yet (run --stages pretrain), skipped", flush=True)
            return None
        newest = [key, *itertools.takewhile(lambda k: k in rows, rerun_keys(key))][-1]
        kept = os.path.join(starts_dir(self.ledger), f"{newest}.pt")
        if os.path.exists(kept):  # kept beside the ledger: a workdir of its own
            restored = os.path.join(self.args.workdir, "checkpoints", f"{newest}.start")
            if recorded_as(restored) != newest:
                os.makedirs(restored, exist_ok=True)
                shutil.copyfile(kept, os.path.join(restored, "checkpoint_best.pt"))
                with open(os.path.join(restored, RECORDED_AS), "w", encoding="utf-8") as f:
                    f.write(newest + "\n")
            return os.path.join(restored, "checkpoint_best.pt")
        rerun = next(k for k in rerun_keys(key) if k not in rows)
        if not self.args.retrain_missing:
            print(f"seed {seed}: {key} is in the ledger but {path} is gone or not a recorded run's (another "
                  f"workdir?); pass --retrain-missing to train it again (recorded as {rerun}), skipped", flush=True)
            return None
        self.pretrain(seed, key=rerun)
        return path if recorded_as(save) == rerun else None

    def tune(self, seed: int) -> None:
        """The fine-tunings to convergence (``--tune-runs``) from the converged checkpoint of ``seed``, those not in
        the ledger yet, at the learning rate :func:`tune_lr_choice` picks: the control at every ``--tune-lrs`` rate
        first, on the sweep seed only (:func:`rate_seed`: once in the ledger, the seed whose control ran at several
        rates). Each restarts Adam at its rate under the pre-training's plateau schedule
        (x0.5 after ``--lr-patience`` epochs without a val BLEU gain), validated every epoch, until
        ``--tune-patience`` epochs without a gain (at most ``--tune-max-epoch``); scored at its best validation."""
        a = self.args
        start = self.pretrained(seed)
        if start is None:
            return
        start_key = recorded_as(os.path.dirname(start))
        # (the ledger's, once its control has run at several rates: naming other seeds later does not move it)
        rows = rows_by_key(self.ledger)
        sweep = rate_seed(rows, self.sweep_seed)
        lrs = a.tune_lrs if seed == sweep else []
        planned = [(TUNE_CONTROL, lr) for lr in lrs]
        chosen = tune_lr_choice(rows, a.tune_lrs, sweep)
        if chosen is None and seed != sweep:
            print(f"tune (seed {seed}): the learning rate is chosen on seed {sweep}'s control at every "
                  f"--tune-lrs rate, not all in the ledger yet; skipped", flush=True)
        for name, lr in planned + [(name, None) for name in a.tune_runs]:
            lr = lr if lr is not None else tune_lr_choice(rows_by_key(self.ledger), a.tune_lrs, sweep)
            if lr is None:
                continue
            m = a.tune_candidates if name in PRUNING_SETTING else 0
            extra = RNNSEARCH + ["--finetune-from-model", start, "--criterion", "soft_beam_search",
                                 "--soft-beam-candidates", str(m), *FINETUNE_RUNS[name], "--lr", str(lr),
                                 *self.converge_args(a.tune_patience, a.tune_max_epoch)]
            self.train(tune_key(name, lr, seed), "tune", "rnnsearch", name, seed, extra,
                       fields={"start": start_key, "lr": lr})

    def attention_args(self, mode: str) -> List[str]:
        """The fairseq-train arguments of an attention arm (``ATTENTION``), after ``COMMON`` and before the seed:
        the transformer from scratch with the pre-training's convergence rule (docs/topk_attention.md's recipe)."""
        return (TRANSFORMER + ATTENTION[mode] + ["--lr", str(self.args.lr), "--warmup-updates", "200",
                                                 "--criterion", "label_smoothed_cross_entropy"]
                + self.converge_args(PATIENCE.get(mode)))

    def blind_for_ledger(self) -> None:
        """``blind``: the blind sets translated by every ledger run whose ``checkpoint_best.pt`` is in the workdir and
        whose translations are not kept yet; says which runs have no checkpoint here."""
        self.prepare_blind()
        missing = []
        rows = rows_by_key(self.ledger)
        for key, row in rows.items():
            if row["stage"] == "pruning":
                continue
            save = os.path.join(self.args.workdir, "checkpoints", RERUN.sub("", key))
            wanted = [os.path.join(blind_dir(self.ledger), f"{key}.{name}.{self.tgt}.gz") for name in self.blind]
            if all(os.path.exists(path) for path in wanted):
                continue
            # (a rerun trains into its original's folder: the checkpoint there is the last recorded one's)
            if recorded_as(save) != key or not os.path.exists(os.path.join(save, "checkpoint_best.pt")):
                missing.append(key)
                continue
            print(f"{key}: translating the blind sets", flush=True)
            self.keep_blind(key, translate_blind(self.data, os.path.join(save, "checkpoint_best.pt"),
                                                 list(self.blind), os.path.join(save, "blind")))
        if missing:
            print(f"no checkpoint in {self.args.workdir} (no blind translations): {', '.join(missing)}", flush=True)

    def carry(self) -> None:
        """``carry``: every run in flight in the workdir -- a checkpoint folder with a ``checkpoint_last.pt`` and no
        recorded run (:data:`RECORDED_AS`) -- kept beside the ledger (:func:`carried_dir`, :func:`carry_run`), for
        ``run`` on another machine to continue it from its last epoch. Stop the runs first: a checkpoint being
        written is not one to copy."""
        root = os.path.join(self.args.workdir, "checkpoints")
        self.prepare_blind()
        recorded = rows_by_key(self.ledger)
        carried = 0
        for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            save = os.path.join(root, name)
            if recorded_as(save) is None and os.path.exists(os.path.join(save, LAST)):
                unmarked = recorded_unmarked(save, recorded)  # (stopped between its row and its marker)
                if unmarked:
                    print(f"{name}: recorded as {unmarked}, not carried", flush=True)
                    continue
                # a pre-training's best checkpoint is where the fine-tunings start: its weights are carried; any
                # other run's, only what its record reads of it
                starts_others = name.startswith("pretrain.")
                if name in recorded and not starts_others:  # (recorded on another machine: this copy is behind; a
                    print(f"{name}: in the ledger, not carried", flush=True)  # pre-training's folder holds reruns)
                    continue
                if not starts_others and not self.blind:
                    print(f"{name}: WARNING no --blind: its best checkpoint is carried scored without the blind "
                          "sets' translations", flush=True)
                dest = os.path.join(carried_dir(self.ledger), name)
                updates = carry_run(save, dest, score_best=None if starts_others else self.score)
                size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(dest) for f in files)
                print(f"{name}: carried at update {updates} into {dest} ({size / 2**20:.1f} MiB)", flush=True)
                carried += 1
        print(f"{carried} run(s) in flight carried" + ("" if carried else f" (none in {root})"), flush=True)

    def run(self) -> None:
        a = self.args
        self.prepare()
        self.prepare_blind()
        os.makedirs(a.workdir, exist_ok=True)
        self.data_fingerprint = prepared_fingerprint(self.data)
        self.check_ledger()
        if "pretrain" in a.stages:
            for seed in a.seeds:
                self.pretrain(seed)
        if "pruning" in a.stages:  # first: it picks the fine-tuning's M (--candidates auto)
            self.pruning(a.seeds[0])
        if "sweep" in a.stages:
            self.finetune(self.sweep_seed, SWEEP)
        if "finetune" in a.stages:
            for seed in a.seeds:
                self.finetune(seed, [n for n in map(self.run_name, a.runs) if n is not None])
        if "tune" in a.stages:
            for seed in a.seeds:
                self.tune(seed)
        if "attention" in a.stages:
            for seed in a.seeds:
                for mode in a.attention_modes:
                    self.train(f"attention.{mode}.seed{seed}", "attention", "transformer_topk_attn", mode, seed,
                               self.attention_args(mode))


# ------------------------------------------------------------------------------------------- report ----

def report(args) -> str:
    """The results page of the ``--pair LEDGER DATA`` studies (``report.py``), to ``--out`` or stdout."""
    import report as page  # (its dependencies, sacrebleu and matplotlib, only for this command)

    if not args.pair:
        raise SystemExit("multi30k_converged report: give --pair LEDGER DATA (once per language pair)")
    pairs = [page.load_pair(ledger, data, target_language(data), args.valid_name, args.test_name)
             for ledger, data in args.pair]
    text = page.render(pairs, plot_path=args.plot, page_path=args.out)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        print(f"multi30k_converged report: {args.out}" + (f" and {args.plot}" if args.plot else ""), flush=True)
    else:
        print(text)
    return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["run", "report", "blind", "carry"])
    p.add_argument("--data", default=os.path.join(REPO_ROOT, "..", "shared", "data", "multi30k_en_fr"))
    p.add_argument("--blind", help=f"a folder of blind test sources (NAME.{SRC}, no references): every scored run "
                                   "translates them into LEDGER.blind/KEY.NAME.TGT.gz, for scoring outside the study")
    p.add_argument("--valid-name", default="val")
    p.add_argument("--test-name", default="test_2016_flickr")
    p.add_argument("--workdir", default=os.path.join(REPO_ROOT, "work", "converged"))
    p.add_argument("--ledger", help="the ledger (JSON lines; default WORKDIR/ledger.jsonl)")
    p.add_argument("--prepared", help="prepared data of another workdir (its data/), instead of preparing anew")
    p.add_argument("--bpe-size", type=int, default=8000)
    p.add_argument("--stages", nargs="+", default=["pretrain", "pruning", "sweep", "finetune", "attention"],
                   choices=["pretrain", "pruning", "sweep", "finetune", "tune", "attention"],
                   help="(run in this order whatever order they are given in)")
    p.add_argument("--sweep-seed", type=int, help=f"the seed the sweep ({', '.join(SWEEP)}) fine-tunes, whose val "
                                                  f"BLEU picks {BEST} (default: the first of --seeds)")
    p.add_argument("--pruning-batches", type=int, default=2, help="validation batches of the pruning comparison")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate of the from-scratch runs")
    p.add_argument("--patience", type=int, default=5, help="early stopping: epochs without a val BLEU gain")
    p.add_argument("--lr-patience", type=int, default=1, help="epochs without a gain before the rate halves")
    p.add_argument("--max-epoch", type=int, default=60, help="cap; a run that reaches it is not converged")
    p.add_argument("--runs", nargs="+", default=DEFAULT_FINETUNE, choices=[*FINETUNE_RUNS, BEST],
                   help=f"the fine-tunings ({BEST}: the sweep's choice on val)")
    p.add_argument("--candidates", default="auto",
                   help="--soft-beam-candidates of the soft fine-tunings: a number, or auto (the pruning comparison's "
                        f"choice: the smallest M with gradient cosine >= {GRAD_COSINE_MIN} to exact, else exact)")
    p.add_argument("--finetune-lr", type=float, default=1e-4)
    p.add_argument("--finetune-epochs", type=int, default=2)
    p.add_argument("--finetune-validate-updates", type=int, default=50)
    p.add_argument("--tune-runs", nargs="+", default=TUNE_RUNS, choices=list(FINETUNE_RUNS),
                   help="tune: the fine-tunings to convergence")
    p.add_argument("--tune-lrs", type=float, nargs="+", default=[1e-3, 5e-4],
                   help="tune: the candidate restart rates; the control's best val BLEU on the sweep seed picks one")
    p.add_argument("--tune-patience", type=int, default=5, help="tune: early stopping, epochs without a val BLEU gain")
    p.add_argument("--tune-max-epoch", type=int, default=30, help="tune: cap; a run that reaches it is not converged")
    p.add_argument("--tune-candidates", type=int, default=50,
                   help="tune: --soft-beam-candidates of the soft fine-tunings (0: the exact search)")
    p.add_argument("--attention-modes", nargs="+", default=list(ATTENTION), choices=list(ATTENTION))
    p.add_argument("--extra-args", default="", help="fairseq-train arguments appended to every run, last (e.g. "
                                                    "smaller sizes for a smoke test); recorded in the ledger")
    p.add_argument("--retrain-missing", action="store_true",
                   help="train again a pre-training that the ledger has but the workdir lacks (fine-tuning and pruning "
                        "start from its checkpoint); recorded as KEY.rerun (KEY.rerun2, ... after the first)")
    p.add_argument("--verbose", action="store_true", help="stream fairseq's logs to the terminal")
    p.add_argument("--pair", nargs=2, action="append", metavar=("LEDGER", "DATA"),
                   help="report: a ledger and the raw data its runs were trained on (the references); once per pair")
    p.add_argument("--out", help="report: the page to write (default: stdout)")
    p.add_argument("--plot", help="report: the per-seed BLEU plot to write (PNG)")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.command == "run":
        Study(args).run()
    elif args.command == "blind":
        Study(args).blind_for_ledger()
    elif args.command == "carry":
        Study(args).carry()
    else:
        report(args)


if __name__ == "__main__":
    main()
