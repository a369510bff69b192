"""Using what the pipeline trained: translate new text and score further test sets with a workdir's models,
through the same Moses tokenisation, BPE, dictionaries and detokenisation the pipeline used.

    python -m softtopk_fairseq.pipeline translate --workdir W [--checkpoint tf] [--beam 5] < in.en > out.fr
    python -m softtopk_fairseq.pipeline score --workdir W --test PREFIX [PREFIX ...] [--checkpoint ...]

From Python, :func:`from_workdir` returns fairseq's hub interface (``GeneratorHubInterface``) with the
workdir's tokenizer and BPE configured, so ``.translate("a sentence")`` works as for fairseq's own models.

Translation goes through the hub interface: text -> Moses tokeniser (no escaping, no aggressive dash
splits, as ``text.moses_tokenize``) -> BPE -> the workdir's dictionary -> beam search with the pipeline's
length limits -> BPE removed -> Moses detokeniser. On the pipeline's own test set it reproduces
``fairseq-generate``'s hypotheses (tested), so BLEU from ``score`` is comparable with the results table.
"""
import json
import os
import sys
from typing import BinaryIO, Dict, List, Optional, Sequence, TextIO

from softtopk_fairseq.pipeline import text, workdir

# Decoding limits of the pipeline's evaluation (fairseq-generate's --max-len-a/--max-len-b), used by both
# the pipeline's fairseq-generate command line and the hub interface here.
MAX_LEN = {"max_len_a": 1.5, "max_len_b": 10}
# Sentences per decoding batch (fairseq-generate's --batch-size; no token cap). fairseq's length limit
# counts from the longest source in a batch, so a hypothesis that reaches it depends on the batching: both
# paths batch alike to give the same translations.
DECODE_BATCH = 128
DEFAULT_BEAM = 5
SCORES_FILE = "scores.jsonl"  # one JSON line per (test set, checkpoint, beam) scored by `score`
SCORES_HEADING = "## Further test sets (`score`)"


class Workdir:
    """A finished (or partly finished) pipeline workdir: its run's options, BPE model and checkpoints."""

    def __init__(self, path: str):
        self.path = path
        record = os.path.join(path, "run.json")
        if not os.path.isfile(record):
            raise SystemExit(f"{path}: no run.json, so not a workdir of this pipeline; give the --workdir a "
                             "pipeline run wrote (python -m softtopk_fairseq.pipeline --workdir DIR ...)")
        with open(record, encoding="utf-8") as f:
            self.options = json.load(f)["options"]
        self.src, self.tgt, self.bpe = self.options["src"], self.options["tgt"], self.options["bpe"]
        self.stages = workdir.Stages(path)
        if not self.stages.done("bin"):
            raise SystemExit(f"{path}: the run has not binarized its data yet (no dictionaries); run the pipeline "
                             "to the end first (the same command resumes it)")

    @property
    def bin_dir(self) -> str:
        return os.path.join(self.path, "bin")

    @property
    def bpe_model(self) -> str:
        return text.JointBPE(self.bpe, os.path.join(self.path, "bpe")).model_path

    def checkpoints(self) -> List[str]:
        """Names of the checkpoints whose training finished: ``tf`` (the pre-training), then the fine-tuning runs
        (``ft_...``) in name order."""
        root = os.path.join(self.path, "checkpoints")
        names = sorted(os.listdir(root), key=lambda n: (n != "tf", n)) if os.path.isdir(root) else []
        return [n for n in names if self.stages.done(f"train.{n}") and os.path.isfile(self.checkpoint_path(n))]

    def checkpoint_path(self, name: str) -> str:
        return os.path.join(self.path, "checkpoints", name, "checkpoint_last.pt")

    def check_checkpoint(self, name: str) -> None:
        available = self.checkpoints()
        if name not in available:
            raise SystemExit(f"{self.path}: no finished checkpoint {name!r}; this workdir has: "
                             f"{', '.join(available) or 'none yet (run the pipeline to the end first)'}")

    def hub_overrides(self) -> Dict[str, object]:
        """fairseq arguments that give the hub interface this run's tokenizer and BPE (and keep every batch)."""
        if self.bpe == "subword_nmt":
            codec = dict(tokenizer="moses", source_lang=self.src, target_lang=self.tgt,
                         moses_no_escape=True, moses_no_dash_splits=True,
                         bpe="subword_nmt", bpe_codes=self.bpe_model)
        else:
            codec = dict(bpe="sentencepiece", sentencepiece_model=self.bpe_model)
        return dict(codec, required_batch_size_multiple=1, batch_size=DECODE_BATCH, max_tokens=None)

    def hub(self, checkpoint: str, device: str = "cpu"):
        """:func:`from_workdir` for this workdir."""
        self.check_checkpoint(checkpoint)  # before importing fairseq: a wrong name fails fast, quietly

        from fairseq import hub_utils

        import softtopk_fairseq

        loaded = hub_utils.from_pretrained(
            os.path.dirname(self.checkpoint_path(checkpoint)), checkpoint_file="checkpoint_last.pt",
            data_name_or_path=os.path.abspath(self.bin_dir), user_dir=softtopk_fairseq.user_dir(),
            **self.hub_overrides())
        hub = hub_utils.GeneratorHubInterface(loaded["args"], loaded["task"], loaded["models"])
        return hub.to(device).eval()


def from_workdir(path: str, checkpoint: str = "tf", device: str = "cpu"):
    """fairseq's ``GeneratorHubInterface`` for ``checkpoint`` (``tf``, ``ft_tf``, ``ft_soft_beam``,
    ``ft_topk_attn``) of the pipeline workdir ``path``, with its Moses tokenizer / BPE and dictionaries:
    ``from_workdir("work/demo").translate("a man is riding a horse .", beam=5)``.
    Note the hub's own ``translate`` defaults: pass ``**MAX_LEN`` to decode exactly as the pipeline does
    (:func:`translate_lines` does)."""
    return Workdir(path).hub(checkpoint, device)


def translate_lines(hub, lines: Sequence[str], beam: int = DEFAULT_BEAM) -> List[str]:
    """One translation per line, in order; an empty (or blank) line gives an empty line. All lines go to the
    hub at once: it sorts them by length into batches as fairseq-generate does."""
    out = [""] * len(lines)
    todo = [i for i, line in enumerate(lines) if line.strip()]
    if todo:
        for i, hyp in zip(todo, hub.translate([lines[i] for i in todo], beam=beam, **MAX_LEN)):
            out[i] = hyp
    return out


def read_utf8_lines(stream: BinaryIO, name: str) -> List[str]:
    """Lines of a byte stream, decoded as UTF-8; a one-line error naming the line otherwise."""
    lines = []
    for number, raw in enumerate(stream, 1):
        try:
            lines.append(raw.decode("utf-8").rstrip("\r\n"))
        except UnicodeDecodeError as e:
            raise SystemExit(f"{name}, line {number}: not UTF-8 text ({e.reason} at byte {e.start}); convert "
                             "it, e.g. iconv -f latin1 -t utf-8")
    return lines


def translate(path: str, checkpoint: str, beam: int, source: BinaryIO, sink: TextIO) -> int:
    """The ``translate`` subcommand: lines of ``source`` to ``sink``, one out per line in; returns the
    number of lines. The workdir and checkpoint are checked before the input is read (it may be a terminal, read
    until Ctrl-D), the input before the model is loaded."""
    wd = Workdir(path)
    wd.check_checkpoint(checkpoint)
    lines = read_utf8_lines(source, "standard input")
    hub = wd.hub(checkpoint)
    for hyp in translate_lines(hub, lines, beam):
        sink.write(hyp + "\n")
    sink.flush()
    print(f"translated {len(lines)} lines with {wd.checkpoint_path(checkpoint)} (beam {beam})",
          file=sys.stderr)
    return len(lines)


def score(path: str, tests: Sequence[str], checkpoints: Optional[Sequence[str]], beam: int) -> List[dict]:
    """The ``score`` subcommand: BLEU (detokenised sacrebleu, as the pipeline) of each checkpoint on each raw
    test set ``PREFIX.SRC``/``PREFIX.TGT``; rows appended to ``WORKDIR/scores.jsonl`` and shown in
    ``WORKDIR/results.md``. Every input is checked before any model is loaded."""
    import sacrebleu

    wd = Workdir(path)
    names = list(checkpoints) if checkpoints else wd.checkpoints()
    for name in names:
        wd.check_checkpoint(name)
    workdir.check_inputs({f"test {i + 1}": prefix for i, prefix in enumerate(tests)}, (wd.src, wd.tgt),
                         flag="--test")
    rows = []
    for name in names:
        hub = wd.hub(name)
        for prefix in tests:
            sources = text.read_lines(f"{prefix}.{wd.src}")
            refs = text.read_lines(f"{prefix}.{wd.tgt}")
            hyps = translate_lines(hub, sources, beam)
            if len(hyps) != len(refs):  # translate_lines keeps one line per line; a broken model must not score
                raise RuntimeError(f"{len(hyps)} hypotheses for {len(refs)} references of {prefix}")
            bleu = sacrebleu.metrics.BLEU()
            result = bleu.corpus_score(hyps, [refs])
            row = {"test": os.path.abspath(prefix), "checkpoint": name, "beam": beam, "sentences": len(refs),
                   "bleu": round(result.score, 2), "signature": str(bleu.get_signature())}
            print(f"{name} on {prefix} (beam {beam}, {len(refs)} sentences): BLEU {row['bleu']:.2f}  "
                  f"[sacrebleu {row['signature']}]", flush=True)
            rows.append(row)
            with open(os.path.join(path, SCORES_FILE), "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")  # recorded the moment it is measured
    write_results(path)
    return rows


def scores_section(path: str) -> str:
    """The results.md section listing the rows of ``scores.jsonl`` ('' when nothing was scored): the latest of each
    test set, checkpoint and beam (``scores.jsonl`` keeps every one). The signature's ``|`` are escaped: it is one
    table cell."""
    file = os.path.join(path, SCORES_FILE)
    if not os.path.isfile(file):
        return ""
    with open(file, encoding="utf-8") as f:
        latest = {}
        for row in (json.loads(line) for line in f if line.strip()):
            latest[row["test"], row["checkpoint"], row["beam"]] = row
    lines = [SCORES_HEADING, "", "| test set | checkpoint | beam | sentences | BLEU | sacrebleu signature |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['test']} | {r['checkpoint']} | {r['beam']} | {r['sentences']} | {r['bleu']:.2f} | "
              f"{r['signature'].replace('|', chr(92) + '|')} |" for r in latest.values()]
    return "\n".join(lines) + "\n"


def write_results(path: str, summary: Optional[str] = None) -> None:
    """Write ``WORKDIR/results.md``: the pipeline's ``summary`` (or the one already there) followed by the
    further test sets' section."""
    results = os.path.join(path, "results.md")
    if summary is None:
        summary = ""
        if os.path.isfile(results):
            with open(results, encoding="utf-8") as f:
                summary = f.read().split(SCORES_HEADING)[0].rstrip("\n")
    section = scores_section(path)
    with open(results + ".tmp", "w", encoding="utf-8") as f:
        f.write(summary + "\n" + ("\n" + section if section else ""))
    os.replace(results + ".tmp", results)


def main(command: str, argv: List[str]) -> None:
    import argparse

    p = argparse.ArgumentParser(prog=f"python -m softtopk_fairseq.pipeline {command}",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="a workdir the pipeline wrote")
    p.add_argument("--beam", type=int, default=DEFAULT_BEAM, help=f"beam size (default: {DEFAULT_BEAM})")
    if command == "translate":
        p.add_argument("--checkpoint", default="tf",
                       help="which model: tf (teacher forcing), ft_tf, ft_soft_beam, ft_topk_attn (default: tf)")
    else:
        p.add_argument("--test", nargs="+", required=True, metavar="PREFIX",
                       help="raw test sets PREFIX.SRC / PREFIX.TGT (the run's languages)")
        p.add_argument("--checkpoint", nargs="+", help="which models (default: every finished one)")
    args = p.parse_args(argv)
    if args.beam < 1:  # before any model is loaded (fairseq would fail deep inside the search)
        p.error(f"--beam must be >= 1, got {args.beam}")
    if command == "translate":
        translate(args.workdir, args.checkpoint, args.beam, sys.stdin.buffer, sys.stdout)
    else:
        score(args.workdir, args.test, args.checkpoint, args.beam)
