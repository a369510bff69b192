"""What makes the pipeline safe to re-run: every input is checked before the workdir is touched, a workdir
belongs to one run, and an interrupted run resumes.

* :func:`check_inputs` -- the raw files exist, are UTF-8, non-empty and line-aligned (empty lines are
  reported, and kept); every problem is one line naming the file and the fix, raised before anything is
  written. Held-out pairs that are training pairs too are counted (a warning when all are).
* :func:`location_problems` -- the workdir can be a directory this user writes (not a file, nor below one).
* :func:`claim` -- ``WORKDIR/run.json`` records what defines the run (the options that change its results
  and the size and modification time of each input file). A fresh or empty workdir is claimed; one that
  holds the same run is resumed; one whose run differs only in options of stages it has not completed takes
  the new ones (an option that fails at its own stage, such as a BPE size the corpus cannot fill, is
  corrected in place); one that holds a different run, or files of unknown origin, is refused with the
  differences listed -- never wiped.
* :class:`Stages` -- a stage is complete when its marker ``WORKDIR/.stages/NAME.done`` exists, written only
  after the stage finished; an incomplete stage's own outputs are cleared and redone (training stages
  continue from fairseq's ``checkpoint_last.pt`` instead).
"""
import json
import os
import shutil
from dataclasses import asdict
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

# Options that do not change a run's results: they may differ between a run and its resumption.
NOT_PART_OF_THE_RUN = ("workdir", "threads")


def check_inputs(splits: Dict[str, Optional[str]], langs, max_lines: int = 0,
                 flag: Optional[str] = None) -> Dict[str, int]:
    """Check the raw text files ``PREFIX.LANG`` of each split; returns split -> number of sentence pairs.
    Raises SystemExit with one line per problem; prints a note on empty lines (they are kept). ``flag``: the
    command-line option the prefixes came from (default ``--SPLIT``)."""
    problems, counts = [], {}
    texts = {}  # split -> (source lines, target lines) of the line-aligned splits, for the overlap count
    for split, prefix in splits.items():
        lines_of, empty = {}, {}
        for lang in langs:
            path = f"{prefix}.{lang}"
            if not os.path.isfile(path):
                problems.append(f"{path}: missing file (give {flag or '--' + split} PREFIX with PREFIX.{langs[0]} and "
                                f"PREFIX.{langs[1]} both present)")
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    lines = [line.rstrip("\n") for line in f]
            except UnicodeDecodeError as e:
                problems.append(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); convert it, e.g. "
                                f"iconv -f latin1 -t utf-8")
                continue
            if max_lines > 0 and split == "train":
                lines = lines[:max_lines]
            if not lines:
                problems.append(f"{path}: empty file (no sentences to use for {split})")
                continue
            lines_of[lang] = lines
            empty[lang] = sum(1 for line in lines if not line.strip())
        if len(lines_of) < 2:
            continue
        a, b = langs
        if len(lines_of[a]) != len(lines_of[b]):
            problems.append(f"{prefix}: {len(lines_of[a])} lines in .{a} but {len(lines_of[b])} in .{b}; the files "
                            "must be line-aligned translations of each other")
            continue
        counts[split] = len(lines_of[a])
        texts[split] = lines_of[a], lines_of[b]
        for lang, n in empty.items():
            if n:
                print(f"note: {prefix}.{lang} has {n} empty line(s); kept (as empty sentences)")
    if problems:
        raise SystemExit("input error:\n  " + "\n  ".join(problems))
    if "train" in texts:
        _note_held_out_pairs_in_train(splits, texts)
    return counts


def _note_held_out_pairs_in_train(splits: Dict[str, Optional[str]], texts) -> None:
    """Say how many pairs of each held-out split also occur in the training pairs (a held-out BLEU over them
    measures recall, not translation); a warning when all do -- e.g. ``--test`` naming the training data.
    ``texts``: split -> (source lines, target lines), as :func:`check_inputs` read them."""
    held_out = {split: list(zip(*lines)) for split, lines in texts.items() if split != "train"}
    wanted = {pair for pairs in held_out.values() for pair in pairs}
    seen = {pair for pair in zip(*texts["train"]) if pair in wanted}
    for split, pairs in held_out.items():
        found = sum(pair in seen for pair in pairs)
        if found == len(pairs):
            print(f"warning: every --{split} pair ({splits[split]}) is also a --train pair: its BLEU will measure "
                  "recall of the training data, not translation")
        elif found:
            print(f"note: {found} of {len(pairs)} --{split} pairs ({splits[split]}) are also --train pairs")


def location_problems(workdir: str) -> List[str]:
    """What keeps ``workdir`` from being created or written (a file in its place, or a folder on its path that
    cannot be written): one line naming ``--workdir`` and the fix, checked with the options, before anything is
    written."""
    path = os.path.abspath(workdir)
    if os.path.exists(path) and not os.path.isdir(path):
        return [f"--workdir {workdir} is a file, not a directory; give a new directory or one of this pipeline's"]
    existing = path
    while not os.path.exists(existing):  # the nearest folder that exists: where the rest would be created
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return [f"--workdir {workdir}: {existing} is a file, so no directory can be made below it"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"--workdir {workdir}: {existing} cannot be written (permission denied); give a directory you "
                "can write"]
    return []


def fingerprint(cfg, input_files: List[str]) -> dict:
    """What defines a run: its result-changing options and, per input file, its size and modification time."""
    options = {k: v for k, v in asdict(cfg).items() if k not in NOT_PART_OF_THE_RUN}
    files = {}
    for path in input_files:
        st = os.stat(path)
        files[os.path.abspath(path)] = [st.st_size, int(st.st_mtime)]
    return {"options": json.loads(json.dumps(options)), "inputs": files}


class Claim(NamedTuple):
    """What :func:`claim` found: whether the workdir holds an earlier start of this run, and the stages (names
    their markers begin with) whose options changed -- none of them complete, so their partial work must go."""

    resumed: bool
    changed: Tuple[str, ...] = ()


def claim(workdir: str, run: dict, stages: Sequence[str] = (), first_changed: Optional[Dict[str, str]] = None
          ) -> Claim:
    """Make ``workdir`` this run's. ``stages``: the names the completion markers begin with, in the order the
    stages run; ``first_changed``: for each option, the first of them it changes (the input files change the
    first). A workdir whose run differs only in options whose first stage, and every later one, is incomplete
    takes the new run; one that holds another run, or files it cannot attribute to one, is refused
    (SystemExit) with nothing changed."""
    record = os.path.join(workdir, "run.json")
    if os.path.isfile(record):
        with open(record, encoding="utf-8") as f:
            previous = json.load(f)
        if previous == run:
            return Claim(resumed=True)
        diff = sorted({k for k in set(previous["options"]) | set(run["options"])
                       if previous["options"].get(k) != run["options"].get(k)})
        first = [(first_changed or {}).get(k) for k in diff]
        if previous.get("inputs") != run["inputs"]:
            diff.append("input files (paths, sizes or modification times)")
            first.append(stages[0] if stages else None)
        made = ""
        if first and None not in first:  # (an option without a stage: the whole run)
            changed = tuple(stages[min(stages.index(name) for name in first):])
            done = Stages(workdir).names()
            complete = [name for stage in changed for name in done if name.startswith(stage)]
            if not complete:
                _write_json(record, run, indent=1, sort_keys=True)
                print(f"{workdir}: options of stages not completed yet changed ({', '.join(diff)}): those stages "
                      "start over with them")
                return Claim(resumed=True, changed=changed)
            made = f", which its completed stage {complete[0]} was made with"
        raise SystemExit(f"{workdir} holds a different run (it differs in: {', '.join(diff)}{made}); nothing was "
                         "changed. Use another --workdir, or delete that one yourself to start over.")
    if os.path.isdir(workdir) and os.listdir(workdir):
        raise SystemExit(f"{workdir} is not empty and holds no run.json of this pipeline; nothing was changed. "
                         "Use another --workdir, or delete that one yourself.")
    os.makedirs(workdir, exist_ok=True)
    _write_json(record, run, indent=1, sort_keys=True)
    return Claim(resumed=False)


def _write_json(path: str, data: dict, **dump_options) -> None:
    """``data`` as JSON in ``path``, atomically (a stopped write leaves the earlier file, or none)."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(data, f, **dump_options)
    os.replace(path + ".tmp", path)


class Stages:
    """Completion markers of the pipeline's stages in ``WORKDIR/.stages``."""

    def __init__(self, workdir: str):
        self.dir = os.path.join(workdir, ".stages")

    def done(self, name: str) -> bool:
        return os.path.isfile(os.path.join(self.dir, f"{name}.done"))

    def names(self) -> List[str]:
        """The completed stages' names, sorted."""
        if not os.path.isdir(self.dir):
            return []
        return sorted(name[:-len(".done")] for name in os.listdir(self.dir) if name.endswith(".done"))

    def mark(self, name: str, data: Optional[dict] = None) -> None:
        """Record that ``name`` finished, with optional data (e.g. its wall time), atomically."""
        os.makedirs(self.dir, exist_ok=True)
        _write_json(os.path.join(self.dir, f"{name}.done"), data or {})

    def data(self, name: str) -> dict:
        with open(os.path.join(self.dir, f"{name}.done"), encoding="utf-8") as f:
            return json.load(f)

    @staticmethod
    def clear(path: str) -> None:
        """Remove an incomplete stage's own output directory (inside a workdir claimed by this run)."""
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, exist_ok=True)
