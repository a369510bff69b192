"""The timing harness the benchmarks share (a library, not a script).

How a figure is measured, once for every benchmark:

* warm-up: each timed function runs untimed first (:func:`warm_up`) -- allocators, caches, compiled kernels, a
  GPU's clocks;
* a baseline timed alternately with the rows it is compared with, in the same process (:func:`compare`): rounds
  of ``baseline, row 1, row 2, ...``, each call timed on its own, and the median of each over the rounds. A drift
  of the machine's speed during the run (a shared machine, a GPU's clocks) hits the baseline and the rows alike,
  so their ratio holds where two separately timed medians would not;
* a call's seconds (:func:`seconds`): wall clock, the device finished before and after the call; or the device's
  own time between two CUDA events (:func:`cuda_event_seconds`);
* the results: a markdown table on stdout (:func:`table_header`, :func:`table_row`), and with ``--json PATH``
  (:func:`add_json_argument`) one JSON line per row appended to PATH (:class:`Results`) -- ``benchmark``, ``row``,
  ``shape`` or ``config``, ``seconds``, ``ratio`` and ``baseline`` (its row and seconds), ``figures`` (the row's
  other measured values), ``machine`` (platform, Python, torch, threads, device), ``command`` (the argv) and
  ``date`` -- from which the results pages are built.

Also here, what the operator's benchmark and experiments time: its shapes (:data:`OPERATOR_SHAPES`), their scores
(:func:`operator_scores`) and one forward + backward call (:func:`forward_backward`).
"""
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

Call = Callable[[], Any]


# ------------------------------------------------------------------------------------------ one call ----

def synchronize(device=None) -> None:
    """Waits for everything queued on ``device`` (a CUDA device; nothing to wait for elsewhere)."""
    if device is not None and str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def seconds(fn: Call, device=None) -> float:
    """Wall-clock seconds of one call of ``fn``, the device idle before it and finished after it."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def cuda_event_seconds(fn: Call, device=None) -> float:
    """Seconds of one call of ``fn`` on the GPU's own clock: between two CUDA events recorded around it (the host's
    time issuing the work is not counted unless the GPU waited for it)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


Timer = Callable[[Call, Any], float]


# ------------------------------------------------------------------------------------ round-robin ----

def warm_up(fns: Mapping[str, Call], times: int = 1) -> None:
    """Each of ``fns`` called ``times`` times, untimed, in turn."""
    for _ in range(times):
        for fn in fns.values():
            fn()


def rounds(fns: Mapping[str, Call], repeats: int, device=None, timer: Timer = seconds) -> Dict[str, List[float]]:
    """``repeats`` rounds, each calling every one of ``fns`` once in their order and timing each call (``timer``);
    every function's seconds, round by round."""
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timer(fn, device))
    return times


@dataclass
class Comparison:
    """Rows timed alternately with a baseline (:func:`compare`): each one's seconds, round by round."""

    baseline: str
    times: Dict[str, List[float]]

    def seconds(self, name: str) -> float:
        """The median seconds of ``name`` (a row, or the baseline) over the rounds."""
        return statistics.median(self.times[name])

    def ratio(self, name: str) -> float:
        """``name``'s median over the baseline's, both from the same rounds."""
        return self.seconds(name) / self.seconds(self.baseline)

    @property
    def rows(self) -> List[str]:
        """The rows compared with the baseline, in their order."""
        return [name for name in self.times if name != self.baseline]


def compare(baseline: Tuple[str, Call], rows: Mapping[str, Call], repeats: int, warmup: int = 1, device=None,
            timer: Timer = seconds) -> Comparison:
    """``rows`` (name -> function) timed alternately with ``baseline`` (its name and function) in one process:
    ``warmup`` untimed rounds, then ``repeats`` rounds ``baseline, *rows``, each call timed alone (``timer``)."""
    name, fn = baseline
    if name in rows:
        raise ValueError(f"compare: the baseline {name!r} is also one of the rows")
    fns = {name: fn, **rows}
    warm_up(fns, warmup)
    return Comparison(name, rounds(fns, repeats, device, timer))


# ------------------------------------------------------------------------------------------- memory ----

def peak_mib(device=None) -> float:
    """The peak memory so far in MiB: on a CUDA device the most torch allocated there, elsewhere this process's
    largest resident set (``ru_maxrss``)."""
    if device is not None and str(device).startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -------------------------------------------------------------------------------------------- output ----

def table_header(columns: Sequence[str]) -> str:
    """A markdown table's header and rule."""
    return "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)


def table_row(cells: Sequence[Any]) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def machine(device: str = "cpu", threads: Optional[int] = None) -> Dict[str, Any]:
    """What the figures were measured on: the platform, Python, torch, its threads (``threads``, else this
    process's) and the device (a GPU's name, else the processor's)."""
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
    else:
        name = platform.processor() or platform.machine() or "cpu"
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads() if threads is None else threads, "device": str(device),
            "device_name": name}


def add_json_argument(parser) -> None:
    """``--json PATH``: the rows also appended to PATH as JSON lines (:class:`Results`)."""
    parser.add_argument("--json", metavar="PATH",
                        help="also append one JSON line per row to PATH: benchmark, row, shape or config, seconds, "
                             "ratio and baseline, figures, machine, command, date")


@dataclass
class Results:
    """One benchmark's rows as JSON lines, appended to ``path`` as they come (nothing written without a path);
    ``machine`` and ``command`` (default: :func:`machine` on ``device``, and this process's argv) go into every
    row."""

    benchmark: str
    path: Optional[str] = None
    device: str = "cpu"
    threads: Optional[int] = None
    command: List[str] = field(default_factory=lambda: list(sys.argv))
    machine: Optional[Dict[str, Any]] = None
    rows: List[dict] = field(default_factory=list)

    def add(self, row: str, seconds: float, *, shape: Optional[str] = None, config: Optional[dict] = None,
            baseline: Optional[str] = None, baseline_seconds: Optional[float] = None, **figures) -> dict:
        """Records the row ``row`` measured at ``seconds`` (on ``shape`` or with ``config``); with ``baseline``
        (the name of the row it was timed alternately with) and that one's ``baseline_seconds`` from the same
        rounds, ``ratio`` is seconds / baseline_seconds. ``figures``: the row's other measured values."""
        if self.machine is None:
            self.machine = machine(self.device, self.threads)
        record = {"benchmark": self.benchmark, "row": row}
        if shape is not None:
            record["shape"] = shape
        if config is not None:
            record["config"] = config
        record.update(
            seconds=seconds,
            ratio=None if baseline is None else seconds / baseline_seconds,
            baseline=None if baseline is None else {"row": baseline, "seconds": baseline_seconds},
            figures=figures, machine=self.machine, command=self.command,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        self.rows.append(record)
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
        return record


def read_rows(path: str) -> List[dict]:
    """The JSON lines of ``path`` (a ``--json`` file)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------- the operator's call ----

# rows x n of the operator's benchmark and experiments: a generic size, the top-k attention's (many short rows)
# and the beam search's (few rows of k * V candidates).
OPERATOR_SHAPES = {"generic": (64, 1000), "attention": (7680, 32), "beam": (8, 50000)}
OPERATOR_K = 5


def operator_scores(name: str, rows: int, n: int, generator):
    """Random scores of shape ``name``: standard normal, or for ``beam`` cumulative log-probabilities of
    candidates."""
    import torch

    x = torch.randn(rows, n, generator=generator)
    if name == "beam":
        x = torch.log_softmax(3 * x, dim=-1)
    return x


def forward_backward(op: Callable, x, weights) -> Call:
    """One call of ``op`` on a fresh leaf of ``x`` and the backward of a fixed random linear loss
    ``(out * w).sum()``, its gradient ``w`` handed to ``out.backward`` (no loss operations in the timing):
    ``weights`` (x's shape plus a rank dimension) weigh a sorted output's ranks, its first column an unsorted
    output (contiguous copies made once, outside the timed call)."""
    grads = {}

    def run():
        xg = x.detach().requires_grad_()
        out = op(xg)
        key = out.shape[-1] if out.dim() == x.dim() + 1 else None
        if key not in grads:
            grads[key] = (weights[..., :key] if key is not None else weights[..., 0]).contiguous()
        out.backward(grads[key])
    return run
