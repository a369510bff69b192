"""The offline demo pipeline: raw parallel text -> BPE -> fairseq-preprocess -> fairseq-train (teacher
forcing) -> fine-tuning for the same number of updates by continued teacher forcing, soft beam search and top-k
attention -> fairseq-generate -> sacrebleu, ending with a results table.

    python -m softtopk_fairseq.pipeline                    # generated toy en->fr corpus (default)
    python -m softtopk_fairseq.pipeline --train DATA/train --valid DATA/val \\
        --test DATA/test_2016_flickr --src en --tgt fr     # any line-aligned text files

Every fairseq step runs the real command line (``fairseq-train --user-dir user_dir ...``) in a
subprocess whose log streams to the terminal and to ``WORKDIR/logs/``. The table goes to stdout and to
``WORKDIR/results.md``.

Safe to re-run (``workdir.py``): the options and inputs are checked before the workdir is touched, a workdir
that holds a different run is refused (never wiped), and running the same command again after an interruption
resumes -- completed stages are skipped, an interrupted training continues from its ``checkpoint_last.pt``. An
option of a stage not completed yet may change (one that failed at its stage is corrected in place).

Using the trained models (``trained.py``; ``--help`` after the subcommand):

    python -m softtopk_fairseq.pipeline translate --workdir W [--checkpoint tf] [--beam 5] < in.en > out.fr
    python -m softtopk_fairseq.pipeline score --workdir W --test PREFIX [PREFIX ...]
"""
import argparse
import math
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import MISSING, dataclass, field, fields
from typing import Dict, List, NamedTuple, Optional, Tuple

import softtopk_fairseq
from softtopk_fairseq import defaults
from softtopk_fairseq.ops.soft_topk import SCALINGS
from softtopk_fairseq.pipeline import text, toy_corpus, trained, workdir

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The user dir inside the package: the pipeline works from an installed package, not only from a clone.
USER_DIR = softtopk_fairseq.user_dir()

# Model sizes: "demo" learns the toy corpus in a few CPU minutes; "tiny" only checks that things run.
ARCH_ARGS: Dict[str, Dict[str, List[str]]] = {
    "transformer": {
        "demo": ["--arch", "transformer", "--share-all-embeddings",
                 "--encoder-layers", "2", "--decoder-layers", "2",
                 "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
                 "--encoder-ffn-embed-dim", "256", "--decoder-ffn-embed-dim", "256",
                 "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
                 "--dropout", "0.1"],
        "tiny": ["--arch", "transformer", "--share-all-embeddings",
                 "--encoder-layers", "1", "--decoder-layers", "1",
                 "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
                 "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
                 "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"],
    },
    "lstm": {
        "demo": ["--arch", "lstm", "--share-decoder-input-output-embed",
                 "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
                 "--encoder-hidden-size", "256", "--decoder-hidden-size", "256",
                 "--decoder-out-embed-dim", "128", "--encoder-bidirectional",
                 "--dropout", "0.1"],
        "tiny": ["--arch", "lstm", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
                 "--encoder-hidden-size", "16", "--decoder-hidden-size", "16",
                 "--decoder-out-embed-dim", "16"],
    },
}


# fairseq 0.12's batch_by_size drops the last batch when its size is not a multiple of
# --required-batch-size-multiple (default 8): generate would silently skip test sentences
# (facebookresearch/fairseq#5036). A multiple of 1 keeps every sentence.
KEEP_LAST_BATCH = ["--required-batch-size-multiple", "1"]

# Warnings that fairseq 0.12 and its hydra set-up raise on every run under current PyTorch -- about their own use
# of deprecated APIs, nothing a user of the pipeline can act on --, filtered in the fairseq processes by category
# and the exact module that raises them (PYTHONWARNINGS; everything else, ours included, still shows).
QUIET_WARNINGS = (
    "ignore::UserWarning:hydra.experimental.initialize", "ignore::UserWarning:hydra.experimental.compose",
    "ignore::UserWarning:hydra.core.default_element", "ignore::UserWarning:hydra.compose",
    "ignore::UserWarning:hydra._internal.defaults_list", "ignore::UserWarning:runpy",
    "ignore::UserWarning:torch.utils.data.dataloader", "ignore::FutureWarning:fairseq.tasks.fairseq_task",
    "ignore::FutureWarning:fairseq.checkpoint_utils", "ignore::FutureWarning:fairseq.trainer",
)


def option(default=MISSING, *, help: str, default_factory=MISSING, **argparse_options):
    """A :class:`Config` field and its command-line flag: the default written once, here; ``help`` and any other
    argparse options (``choices``, ``nargs``, ``metavar``, ``type``) for :func:`parse_args`."""
    return field(default=default, default_factory=default_factory, metadata=dict(argparse_options, help=help))


@dataclass
class Config:
    """The pipeline's options; :func:`parse_args` makes one flag of each field (``--toy-sizes`` for
    ``toy_sizes``) with the field's default."""

    workdir: str = option(help="where data, checkpoints, logs and results.md go (default: work/demo in the clone, or "
                               "in the current directory when the package is installed)")
    src: str = option(toy_corpus.LANGUAGES[0], help="source language: the suffix of the raw files (PREFIX.SRC)")
    tgt: str = option(toy_corpus.LANGUAGES[1], help="target language: the suffix of the raw files (PREFIX.TGT)")
    train: Optional[str] = option(None, help="prefix of raw training text (PREFIX.SRC, PREFIX.TGT; default: the "
                                             "generated toy corpus)")
    valid: Optional[str] = option(None, help="prefix of raw validation text")
    test: Optional[str] = option(None, help="prefix of raw test text")
    toy_sizes: List[int] = option(default_factory=lambda: [20000, 500, 500], nargs=3,
                                  metavar=("TRAIN", "VALID", "TEST"),
                                  help="sentence pairs per split of the generated toy corpus")
    max_lines: int = option(0, help="use only the first N training lines (0: all)")
    bpe: str = option("subword_nmt", choices=text.BPE_METHODS, help="BPE back-end")
    bpe_size: int = option(1000, help="merges (subword-nmt) or vocabulary size (sentencepiece)")
    arch: str = option("transformer", choices=sorted(ARCH_ARGS), help="model architecture")
    size: str = option("demo", choices=["demo", "tiny"], help="model size preset")
    max_update: int = option(600, help="updates of the teacher-forcing training")
    max_tokens: int = option(4096, help="tokens per batch of every training")
    lr: float = option(1e-3, help="peak learning rate of the teacher-forcing training (inverse-sqrt schedule)")
    warmup: int = option(200, help="warm-up updates of that schedule")
    beams: List[int] = option(default_factory=lambda: [1, 5], nargs="+", help="beam sizes to evaluate")
    seed: int = option(1, help="random seed of the toy corpus and of every training")
    threads: int = option(0, help="OMP threads per fairseq process (0: default)")
    finetune_updates: int = option(100, help="updates of each fine-tuning run from the teacher-forcing checkpoint "
                                             "(0: skip)")
    finetune_lr: float = option(1e-4, help="constant learning rate of the fine-tuning")
    teacher_forcing_ratio: float = option(defaults.TEACHER_FORCING_RATIO, help="rho of the soft beam search run")
    soft_beam_size: int = option(defaults.BEAM, help="beam size of the soft beam search run")
    soft_beam_epsilon: float = option(defaults.EPSILON, help="its SOFT top-k temperature (the criterion's "
                                                             "--soft-beam-epsilon)")
    soft_beam_scaling: str = option(defaults.SEARCH_SCALING, choices=SCALINGS,
                                    help="normalisation of its OT cost (the criterion's --soft-beam-scaling)")
    # (the demo prunes to 50 candidates, for speed; the criterion's own default is exact)
    soft_beam_candidates: int = option(50, help="candidates kept per sentence before the soft top-k (0: all k*V)")
    topk_attn_k: int = option(defaults.TOPK_ATTN_K, help="keys per query of the top-k attention run")
    topk_attn_epsilon: float = option(defaults.EPSILON, help="its SOFT top-k temperature")


# The stages in the order they run -- what their completion markers' names begin with -- and, for each option that
# defines the run, the first of them it changes: a workdir takes a corrected option while that stage and every
# later one are incomplete (a --bpe-size the corpus cannot fill fails at the BPE stage, after the raw text).
STAGES = ("raw", "bpe", "bin", "train.tf", "train.ft_", "generate.")
FIRST_STAGE_CHANGED = {
    **dict.fromkeys(("src", "tgt", "train", "valid", "test", "toy_sizes", "max_lines", "seed"), "raw"),
    **dict.fromkeys(("bpe", "bpe_size"), "bpe"),
    **dict.fromkeys(("arch", "size", "max_update", "max_tokens", "lr", "warmup"), "train.tf"),
    **dict.fromkeys(("finetune_updates", "finetune_lr", "teacher_forcing_ratio", "soft_beam_size",
                     "soft_beam_epsilon", "soft_beam_scaling", "soft_beam_candidates", "topk_attn_k",
                     "topk_attn_epsilon"), "train.ft_"),
    "beams": "generate.",
}


# The pipeline's flags of version 0.1 -> their names now: still accepted, with a one-time FutureWarning.
FLAG_ALIASES = {"--soft-topk-epsilon": "--soft-beam-epsilon", "--soft-topk-scaling": "--soft-beam-scaling"}


class Stage:
    """Prints a header and the elapsed time of one pipeline stage."""

    def __init__(self, number: int, total: int, name: str):
        self.label = f"[stage {number}/{total}] {name}"

    def __enter__(self):
        print(f"\n== {self.label} ==", flush=True)
        self.start = time.time()
        return self

    def __exit__(self, *exc):
        self.seconds = time.time() - self.start
        if exc[0] is None:
            print(f"== {self.label}: done in {self.seconds:.1f} s ==", flush=True)


def run_logged(cmd: List[str], log_path: str, env: Optional[dict] = None, echo: bool = True,
               header: str = "") -> str:
    """Run ``cmd``, streaming its output to ``log_path`` (and to stdout when ``echo``), after ``header`` (lines
    the log begins with); return the output; raise on failure, quoting the end of the log when it was not echoed."""
    print("$ " + " ".join(cmd) + ("" if echo else f"  (output: {log_path})"), flush=True)
    # A Python child writing into a pipe, and our log file, would buffer in 8 KiB blocks: unbuffered child and
    # line-buffered log, so the log (tail -f) and the terminal follow the run line by line.
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    lines = []
    with open(log_path, "w", encoding="utf-8", buffering=1) as log, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1
    ) as proc:
        log.write(header)
        for line in proc.stdout:
            if echo:
                sys.stdout.write(line)
            log.write(line)
            lines.append(line)
        proc.wait()
    sys.stdout.flush()
    if proc.returncode != 0:
        tail = "" if echo else "\n" + "".join(lines[-20:])
        raise RuntimeError(f"command failed with exit code {proc.returncode} (log: {log_path}): {' '.join(cmd)}"
                           + tail)
    return "".join(lines)


def fairseq_cmd(tool: str) -> List[str]:
    """``fairseq-<tool>`` of the running interpreter's environment (module form works without PATH)."""
    return [sys.executable, "-m", f"fairseq_cli.{tool}"]


def quiet_warnings_env(env: Optional[dict] = None) -> dict:
    """``env`` (default: this process's) with :data:`QUIET_WARNINGS` added to any ``PYTHONWARNINGS`` it has."""
    env = dict(os.environ if env is None else env)
    env["PYTHONWARNINGS"] = ",".join(filter(None, [env.get("PYTHONWARNINGS", ""), *QUIET_WARNINGS]))
    return env


def subprocess_env(cfg: Config) -> dict:
    env = quiet_warnings_env()
    if cfg.threads > 0:
        env["OMP_NUM_THREADS"] = str(cfg.threads)
    return env


def generated_corpus(cfg: Config) -> bool:
    """Whether the run trains on the generated toy corpus: none of --train, --valid and --test given."""
    return not any((cfg.train, cfg.valid, cfg.test))


def _given_splits(cfg: Config) -> Dict[str, str]:
    """The raw splits the options name (split -> prefix); empty for the generated toy corpus. SystemExit unless
    --train, --valid and --test are given together."""
    if generated_corpus(cfg):
        return {}
    splits = {"train": cfg.train, "valid": cfg.valid, "test": cfg.test}
    missing = [name for name, prefix in splits.items() if not prefix]
    if missing:
        raise SystemExit(f"give --train, --valid and --test together (missing: {', '.join(missing)})")
    return splits


def prepare_raw(cfg: Config, raw_dir: str) -> Dict[str, str]:
    """Write (or link) the raw splits into ``raw_dir``; return split name -> prefix."""
    os.makedirs(raw_dir, exist_ok=True)
    splits = _given_splits(cfg)
    prefixes = {}
    if not splits:
        for (split, n), seed in zip(zip(("train", "valid", "test"), cfg.toy_sizes),
                                    (cfg.seed, cfg.seed + 1000, cfg.seed + 2000)):
            toy_corpus.write_split(os.path.join(raw_dir, split), n, seed, (cfg.src, cfg.tgt))
            prefixes[split] = os.path.join(raw_dir, split)
        return prefixes
    for split, prefix in splits.items():
        for lang in (cfg.src, cfg.tgt):
            if not os.path.exists(f"{prefix}.{lang}"):
                raise SystemExit(f"missing file {prefix}.{lang}")
        limit = cfg.max_lines if split == "train" else 0
        src = text.read_lines(f"{prefix}.{cfg.src}", limit)
        tgt = text.read_lines(f"{prefix}.{cfg.tgt}", limit)
        if len(src) != len(tgt):
            raise SystemExit(f"{prefix}: {len(src)} {cfg.src} lines but {len(tgt)} {cfg.tgt} lines")
        text.write_lines(os.path.join(raw_dir, f"{split}.{cfg.src}"), src)
        text.write_lines(os.path.join(raw_dir, f"{split}.{cfg.tgt}"), tgt)
        prefixes[split] = os.path.join(raw_dir, split)
    return prefixes


def apply_bpe(cfg: Config, raw: Dict[str, str], bpe_dir: str) -> None:
    """Tokenise (subword-nmt only), learn joint BPE on train, encode every split into ``bpe_dir``."""
    bpe = text.JointBPE(cfg.bpe, bpe_dir)
    langs = (cfg.src, cfg.tgt)
    prepared = {}
    for split, prefix in raw.items():
        for lang in langs:
            lines = text.read_lines(f"{prefix}.{lang}")
            prepared[split, lang] = text.moses_tokenize(lines, lang) if bpe.pretokenize else lines
    train_files = []
    for lang in langs:
        path = os.path.join(bpe_dir, f"train.tok.{lang}")
        text.write_lines(path, prepared["train", lang])
        train_files.append(path)
    bpe.learn(train_files, cfg.bpe_size)
    for (split, lang), lines in prepared.items():
        text.write_lines(os.path.join(bpe_dir, f"{split}.{lang}"), bpe.encode(lines))
    print(f"BPE ({cfg.bpe}, size {cfg.bpe_size}): model {bpe.model_path}")


def binarize(bpe_dir: str, bin_dir: str, src: str, tgt: str, log_path: str, workers: int = 1,
             env: Optional[dict] = None) -> None:
    """``fairseq-preprocess`` of ``bpe_dir/{train,valid,test}.{src,tgt}`` with one joined dictionary."""
    run_logged(
        fairseq_cmd("preprocess") + [
            "--source-lang", src, "--target-lang", tgt,
            "--trainpref", os.path.join(bpe_dir, "train"),
            "--validpref", os.path.join(bpe_dir, "valid"),
            "--testpref", os.path.join(bpe_dir, "test"),
            "--destdir", bin_dir, "--joined-dictionary", "--workers", str(workers),
        ],
        log_path, env=env,
    )


TF_CRITERION = ["--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"]


def _base_train_args(cfg: Config, bin_dir: str, save_dir: str, updates: int, log_interval: int) -> List[str]:
    """What every fairseq-train run of the pipeline shares: data, plugin, model size, optimizer, batches,
    checkpoints and logs, ``updates`` updates."""
    return [
        bin_dir, "--user-dir", USER_DIR, "--cpu", "--seed", str(cfg.seed), *ARCH_ARGS[cfg.arch][cfg.size],
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0",
        "--max-tokens", str(cfg.max_tokens), "--max-update", str(updates),
        "--save-dir", save_dir, "--no-epoch-checkpoints", "--save-interval-updates", "0",
        "--log-format", "simple", "--log-interval", str(log_interval), "--num-workers", "0", *KEEP_LAST_BATCH,
    ]


def train_args(cfg: Config, bin_dir: str, save_dir: str) -> List[str]:
    """The teacher-forcing training: inverse-sqrt schedule with warm-up."""
    return [*_base_train_args(cfg, bin_dir, save_dir, cfg.max_update, 50),
            "--lr", str(cfg.lr), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(cfg.warmup),
            *TF_CRITERION]


def finetune_args(cfg: Config, bin_dir: str, restore: Optional[str], save_dir: str,
                  run_args: List[str]) -> List[str]:
    """Continue from the pre-trained checkpoint ``restore`` for ``cfg.finetune_updates`` updates at a constant
    learning rate (fresh optimizer and counters), with the run's criterion (and architecture) arguments; the
    same batches for every run. Later ``--arch`` arguments override the pre-training's. ``restore=None``:
    resume the fine-tuning itself from its own ``checkpoint_last.pt`` in ``save_dir``."""
    start = [] if restore is None else ["--restore-file", restore, "--reset-optimizer", "--reset-lr-scheduler",
                                        "--reset-meters", "--reset-dataloader"]
    return [*_base_train_args(cfg, bin_dir, save_dir, cfg.finetune_updates, 10), *start,
            "--lr", str(cfg.finetune_lr), "--lr-scheduler", "fixed", *run_args]


TOPK_ATTN_ARCH = {"transformer": "transformer_topk_attn", "lstm": "lstm_topk_attn"}


def finetune_runs(cfg: Config) -> Dict[str, Tuple[str, List[str]]]:
    """Run key -> (row name, fairseq-train arguments) of the fine-tuning comparison."""
    n = cfg.finetune_updates
    tf = TF_CRITERION
    soft = ["--criterion", "soft_beam_search", "--label-smoothing", "0.1",
            "--teacher-forcing-ratio", str(cfg.teacher_forcing_ratio), "--soft-beam-size", str(cfg.soft_beam_size),
            "--soft-beam-epsilon", str(cfg.soft_beam_epsilon), "--soft-beam-scaling", cfg.soft_beam_scaling,
            "--soft-beam-candidates", str(cfg.soft_beam_candidates)]
    # The top-k attention layers have the stock layers' parameters, so the softmax checkpoint loads into them.
    topk = ["--arch", TOPK_ATTN_ARCH[cfg.arch], "--topk-attn-k", str(cfg.topk_attn_k),
            "--topk-attn-epsilon", str(cfg.topk_attn_epsilon), *tf]
    return {
        "tf": (f"+ {n} teacher forcing", tf),
        "soft_beam": (f"+ {n} soft beam search (rho {cfg.teacher_forcing_ratio}, beam {cfg.soft_beam_size}, "
                      f"eps {cfg.soft_beam_epsilon} {cfg.soft_beam_scaling} scaling, M {cfg.soft_beam_candidates})",
                      soft),
        "topk_attn": (f"+ {n} teacher forcing, SOFT top-k attention (k {cfg.topk_attn_k}, "
                      f"eps {cfg.topk_attn_epsilon})", topk),
    }


def generate_and_score(cfg: Config, bin_dir: str, checkpoint: str, raw_test: str, beam: int,
                       out_dir: str) -> float:
    """Decode the test split with ``fairseq-generate --beam``; return detokenised sacrebleu BLEU."""
    import sacrebleu

    output = run_logged(
        fairseq_cmd("generate") + [
            bin_dir, "--user-dir", USER_DIR, "--cpu", "--path", checkpoint, "--gen-subset", "test",
            "--beam", str(beam), "--batch-size", str(trained.DECODE_BATCH), "--remove-bpe", text.REMOVE_BPE[cfg.bpe],
            *[f"--{k.replace('_', '-')}={v}" for k, v in trained.MAX_LEN.items()], *KEEP_LAST_BATCH,
        ],
        os.path.join(out_dir, f"generate.beam{beam}.log"),
        env=subprocess_env(cfg), echo=False,  # one line per sentence: the log keeps it, the terminal does not
    )
    hyps = {}
    for line in output.splitlines():
        m = re.match(r"^H-(\d+)\t[^\t]*\t(.*)$", line)
        if m:
            hyps[int(m.group(1))] = m.group(2)
    refs = text.read_lines(f"{raw_test}.{cfg.tgt}")
    if len(hyps) != len(refs):
        raise RuntimeError(f"fairseq-generate produced {len(hyps)} hypotheses for {len(refs)} references")
    hyp_lines = [hyps[i] for i in range(len(refs))]
    if cfg.bpe == "subword_nmt":
        hyp_lines = text.moses_detokenize(hyp_lines, cfg.tgt)
    text.write_lines(os.path.join(out_dir, f"test.beam{beam}.{cfg.tgt}"), hyp_lines)
    return sacrebleu.corpus_bleu(hyp_lines, [refs]).score


def results_table(rows: List[dict], beams: List[int]) -> str:
    head = ["run", "arch", "updates", "train s"] + [f"BLEU beam {b}" for b in beams]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["run"], row["arch"], str(row["updates"]), f"{row['train_s']:.0f}"]
        cells += [f"{row['bleu'][b]:.2f}" for b in beams]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def option_problems(cfg: Config) -> List[str]:
    """What is wrong with the run's options, one line each naming the flag, its value and what it must be:
    checked with the inputs, before the workdir is touched (a bad beam size found after the training would
    cost the training). The soft beam-search and top-k attention options by the criterion's and the layers' own
    rules."""
    from softtopk_fairseq.criterions.soft_beam_search import SoftBeamSearchConfig, config_problems  # fairseq
    from softtopk_fairseq.modules.topk_attention import topk_option_problems

    problems = workdir.location_problems(cfg.workdir)
    if not cfg.src or not cfg.tgt or cfg.src == cfg.tgt:
        problems.append(f"--src and --tgt must be two different languages, got {cfg.src!r} and {cfg.tgt!r}")
    at_least = [("--max-update", cfg.max_update, 1), ("--max-tokens", cfg.max_tokens, 1),
                ("--bpe-size", cfg.bpe_size, 1), ("--max-lines", cfg.max_lines, 0), ("--warmup", cfg.warmup, 0),
                ("--seed", cfg.seed, 0), ("--threads", cfg.threads, 0), ("--finetune-updates", cfg.finetune_updates, 0)]
    if generated_corpus(cfg):  # English and French, its own sizes
        at_least += [(f"--toy-sizes ({split})", n, 1) for split, n in zip(("train", "valid", "test"), cfg.toy_sizes)]
        if cfg.src and cfg.tgt and cfg.src != cfg.tgt and (cfg.src, cfg.tgt) != toy_corpus.LANGUAGES:
            problems.append(f"--src {cfg.src} --tgt {cfg.tgt}: the generated toy corpus is "
                            f"{'->'.join(toy_corpus.LANGUAGES)}; give --train, --valid and --test for other languages")
        if cfg.max_lines:
            problems.append(f"--max-lines {cfg.max_lines} limits --train files; the generated toy corpus's sizes are "
                            "--toy-sizes")
    problems += [f"{flag} must be >= {low}, got {value}" for flag, value, low in at_least if value < low]
    problems += [f"{flag} must be a finite number > 0, got {value}"
                 for flag, value in (("--lr", cfg.lr), ("--finetune-lr", cfg.finetune_lr))
                 if not (math.isfinite(value) and value > 0)]
    if not cfg.beams or min(cfg.beams) < 1 or len(set(cfg.beams)) < len(cfg.beams):
        problems.append(f"--beams must be one or more distinct beam sizes >= 1, got {cfg.beams}")
    problems += config_problems(SoftBeamSearchConfig(
        sentence_avg=False, teacher_forcing_ratio=cfg.teacher_forcing_ratio, soft_beam_size=cfg.soft_beam_size,
        soft_beam_epsilon=cfg.soft_beam_epsilon, soft_beam_scaling=cfg.soft_beam_scaling,
        soft_beam_candidates=cfg.soft_beam_candidates))
    problems += topk_option_problems(cfg.topk_attn_k, cfg.topk_attn_epsilon)
    return problems


def _inputs(cfg: Config) -> List[str]:
    """The raw files the run reads (none for the generated toy corpus), after checking every one of them."""
    splits = _given_splits(cfg)
    if not splits:
        return []
    workdir.check_inputs(splits, (cfg.src, cfg.tgt), cfg.max_lines)
    return [f"{prefix}.{lang}" for prefix in splits.values() for lang in (cfg.src, cfg.tgt)]


def _train(cmd_args: List[str], log_path: str, env: dict, save_dir: str) -> float:
    """One fairseq-train run; says so when it continues from a checkpoint of an interrupted start."""
    if os.path.isfile(os.path.join(save_dir, "checkpoint_last.pt")):
        print(f"  resuming from {os.path.join(save_dir, 'checkpoint_last.pt')} (an earlier start was interrupted)")
    start = time.time()
    run_logged(fairseq_cmd("train") + cmd_args, log_path, env=env)
    return time.time() - start


class _Run(NamedTuple):
    """One trained model the last stage scores."""

    key: str        # its checkpoint directory under WORKDIR/checkpoints
    name: str       # its row of the results table
    updates: int
    arch: str


def _skipped(stages: workdir.Stages, name: str) -> bool:
    """Whether stage ``name`` completed in an earlier start of this run (then said so)."""
    if stages.done(name):
        print(f"  already complete ({name}): skipped")
        return True
    return False


def _data_stages(cfg: Config, stages: workdir.Stages, dirs: Dict[str, str], env: dict, total: int) -> Dict[str, str]:
    """Stages 1-3: the raw text, BPE, fairseq-preprocess; returns the raw splits' prefixes."""
    with Stage(1, total, "raw text"):
        if not _skipped(stages, "raw"):
            workdir.Stages.clear(dirs["raw"])
            prepare_raw(cfg, dirs["raw"])
            stages.mark("raw")
        raw = {split: os.path.join(dirs["raw"], split) for split in ("train", "valid", "test")}
        for split, prefix in raw.items():
            print(f"  {split}: {len(text.read_lines(prefix + '.' + cfg.src))} sentence pairs")
    with Stage(2, total, f"BPE ({cfg.bpe})"):
        if not _skipped(stages, "bpe"):
            workdir.Stages.clear(dirs["bpe"])
            apply_bpe(cfg, raw, dirs["bpe"])
            stages.mark("bpe")
    with Stage(3, total, "fairseq-preprocess"):
        if not _skipped(stages, "bin"):
            workdir.Stages.clear(dirs["bin"])  # fairseq-preprocess refuses to overwrite a dictionary
            binarize(dirs["bpe"], dirs["bin"], cfg.src, cfg.tgt, os.path.join(dirs["logs"], "preprocess.log"),
                     env=env)
            stages.mark("bin")
    return raw


def _training_stages(cfg: Config, stages: workdir.Stages, dirs: Dict[str, str], env: dict,
                     total: int) -> Tuple[List[_Run], Dict[str, float]]:
    """Stage 4, teacher forcing, and stage 5, the fine-tuning runs from its checkpoint (when asked); returns the
    trained models and each one's training time (seconds, this start's or the one that trained it)."""
    runs = [_Run("tf", "teacher forcing", cfg.max_update, cfg.arch)]
    seconds = {}
    with Stage(4, total, f"fairseq-train (teacher forcing, {cfg.arch}, {cfg.max_update} updates)"):
        if not _skipped(stages, "train.tf"):
            save = os.path.join(dirs["checkpoints"], "tf")
            took = _train(train_args(cfg, dirs["bin"], save), os.path.join(dirs["logs"], "train.tf.log"), env, save)
            stages.mark("train.tf", {"seconds": took})
        seconds["tf"] = stages.data("train.tf")["seconds"]
    if cfg.finetune_updates <= 0:
        return runs, seconds
    restore = os.path.join(dirs["checkpoints"], "tf", "checkpoint_last.pt")
    n = cfg.finetune_updates
    with Stage(5, total, f"fine-tuning from the same checkpoint, {n} updates each: teacher forcing, soft beam "
                         "search, top-k attention"):
        for key, (name, run_args) in finetune_runs(cfg).items():
            if not _skipped(stages, f"train.ft_{key}"):
                save = os.path.join(dirs["checkpoints"], f"ft_{key}")
                own = os.path.isfile(os.path.join(save, "checkpoint_last.pt"))
                took = _train(finetune_args(cfg, dirs["bin"], None if own else restore, save, run_args),
                              os.path.join(dirs["logs"], f"train.ft_{key}.log"), env, save)
                stages.mark(f"train.ft_{key}", {"seconds": took})
            seconds[f"ft_{key}"] = stages.data(f"train.ft_{key}")["seconds"]
            arch = run_args[run_args.index("--arch") + 1] if "--arch" in run_args else cfg.arch
            runs.append(_Run(f"ft_{key}", name, cfg.max_update + n, arch))
    return runs, seconds


def _scoring_stage(cfg: Config, stages: workdir.Stages, dirs: Dict[str, str], raw_test: str, runs: List[_Run],
                   seconds: Dict[str, float], total: int) -> List[dict]:
    """The last stage: fairseq-generate at every beam and sacrebleu, for every trained model; its table rows."""
    rows = []
    with Stage(total, total, "fairseq-generate + sacrebleu"):
        for run in runs:
            bleu = {}
            for beam in cfg.beams:
                name = f"generate.{run.key}.beam{beam}"
                if not _skipped(stages, name):
                    out_dir = os.path.join(dirs["logs"], run.key)
                    os.makedirs(out_dir, exist_ok=True)
                    score = generate_and_score(cfg, dirs["bin"],
                                               os.path.join(dirs["checkpoints"], run.key, "checkpoint_last.pt"),
                                               raw_test, beam, out_dir)
                    stages.mark(name, {"bleu": score})
                bleu[beam] = stages.data(name)["bleu"]
                print(f"  {run.name}: BLEU (beam {beam}) = {bleu[beam]:.2f}")
            rows.append({"run": run.name, "arch": run.arch, "updates": run.updates, "train_s": seconds[run.key],
                         "bleu": bleu})
    return rows


def run_pipeline(cfg: Config) -> List[dict]:
    """The whole pipeline in the workdir, every input checked first; a stage completed by an earlier start of the
    same run is skipped, an interrupted training continues from its checkpoint."""
    start = time.time()
    problems = option_problems(cfg)  # every option and input checked before the workdir is touched
    if problems:
        raise SystemExit("option error:\n  " + "\n  ".join(problems))
    inputs = _inputs(cfg)
    resumed, changed = workdir.claim(cfg.workdir, workdir.fingerprint(cfg, inputs), STAGES, FIRST_STAGE_CHANGED)
    stages = workdir.Stages(cfg.workdir)
    dirs = {name: os.path.join(cfg.workdir, name) for name in ("raw", "bpe", "bin", "checkpoints", "logs")}
    for path in dirs.values():
        os.makedirs(path, exist_ok=True)
    for key in os.listdir(dirs["checkpoints"]):  # an interrupted training of changed options starts over
        if f"train.{key}".startswith(changed):
            shutil.rmtree(os.path.join(dirs["checkpoints"], key))
    env = subprocess_env(cfg)
    total = 6 if cfg.finetune_updates > 0 else 5
    source = (f"generated toy {'->'.join(toy_corpus.LANGUAGES)} corpus" if generated_corpus(cfg)
              else f"files {cfg.train}/{cfg.valid}/{cfg.test}")
    print(f"softtopk-fairseq demo pipeline: {source}; workdir {cfg.workdir}"
          + ("; resuming: completed stages are skipped" if resumed else ""))

    raw = _data_stages(cfg, stages, dirs, env, total)
    runs, seconds = _training_stages(cfg, stages, dirs, env, total)
    rows = _scoring_stage(cfg, stages, dirs, raw["test"], runs, seconds, total)

    table = results_table(rows, cfg.beams)
    elapsed = time.time() - start
    summary = f"{table}\n\nBPE: {cfg.bpe}; test sentences: {len(text.read_lines(raw['test'] + '.' + cfg.tgt))}; " \
              f"total time: {elapsed:.0f} s" + (" (this resumed run)" if resumed else "")
    trained.write_results(cfg.workdir, summary)  # keeps the further test sets `score` added
    print("\n" + summary)
    return rows


def _default_workdir() -> str:
    in_clone = os.path.isfile(os.path.join(REPO_ROOT, "scripts", "demo.sh"))
    return os.path.join(REPO_ROOT if in_clone else os.getcwd(), "work", "demo")


def parse_args(argv: Optional[List[str]] = None) -> Config:
    """The :class:`Config` of a command line: one flag per field, its default (shown by ``--help``) the field's."""
    p = argparse.ArgumentParser(prog="python -m softtopk_fairseq.pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(Config):
        options = dict(f.metadata)
        if f.name == "workdir":  # where the package is: known only when the command runs
            default = _default_workdir()
        else:
            default = f.default_factory() if f.default is MISSING else f.default
            if default is not None:
                shown = " ".join(map(str, default)) if isinstance(default, list) else default
                options["help"] += f" (default: {shown})"
        value = default[0] if isinstance(default, list) else default
        options.setdefault("type", str if value is None else type(value))
        flag = "--" + f.name.replace("_", "-")
        old = [alias for alias, name in FLAG_ALIASES.items() if name == flag]
        if old:
            options.update(action=_OldFlagName, help=options["help"] + f" (its old name {', '.join(old)} works too)")
        p.add_argument(flag, *old, default=default, **options)
    return Config(**vars(p.parse_args(argv)))


class _OldFlagName(argparse.Action):
    """Stores the value; given by its old name (:data:`FLAG_ALIASES`), also warns that it is (once per name)."""

    warned = set()

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in FLAG_ALIASES and option_string not in self.warned:
            self.warned.add(option_string)
            warnings.warn(f"{option_string} is the old name of {FLAG_ALIASES[option_string]}; it will be removed",
                          FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, values)


SUBCOMMANDS = ("translate", "score")  # using a finished workdir (trained.py); anything else runs the pipeline


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        trained.main(argv[0], argv[1:])
    else:
        run_pipeline(parse_args(argv))


if __name__ == "__main__":
    main()
