"""The user benchmarks (benchmarks/: the operator, the soft beam-search update, the top-k attention step) run end
to end at tiny sizes and write their JSON rows; their timing harness alternates a baseline with the rows, takes
ratios from the same rounds and writes the rows' fields -- checked on functions whose cost is known."""
import datetime
import os
import re
import subprocess
import sys
import time

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import harness  # noqa: E402

ROW_KEYS = {"benchmark", "row", "seconds", "ratio", "baseline", "figures", "machine", "command", "date"}
BATCH = ["--bsz", "4", "--src-len", "5", "--tgt-len", "4", "--vocab", "60", "--repeats", "1", "--threads", "1"]


def bench(script, *args, timeout=600):
    out = subprocess.run([sys.executable, os.path.join(BENCH, script), *map(str, args)], capture_output=True,
                         text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def table(stdout):
    """The markdown table's rows (header first), cells stripped."""
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in stdout.splitlines()
            if line.startswith("| ") and "---" not in line]


def test_harness_times_the_baseline_alternately_with_the_rows_and_takes_ratios_from_the_same_rounds(tmp_path):
    calls = []

    def sleeping(name, seconds):
        def fn():
            calls.append(name)
            time.sleep(seconds)
        return fn

    timed = harness.compare(("base", sleeping("base", 0.01)), {"slow": sleeping("slow", 0.03),
                                                                "fast": sleeping("fast", 0.001)}, repeats=5, warmup=2)
    # two untimed warm-up rounds, then five timed rounds, the baseline first in each
    assert calls == ["base", "slow", "fast"] * 7
    assert timed.baseline == "base" and timed.rows == ["slow", "fast"]
    assert all(len(t) == 5 for t in timed.times.values())
    assert timed.seconds("slow") == sorted(timed.times["slow"])[2]  # the median of the rounds
    assert 1.8 < timed.ratio("slow") < 4.5 and timed.ratio("fast") < 0.8  # 30 ms / 10 ms; 1 ms / 10 ms
    assert timed.ratio("slow") == timed.seconds("slow") / timed.seconds("base")
    with pytest.raises(ValueError, match="also one of the rows"):
        harness.compare(("base", calls.clear), {"base": calls.clear}, repeats=1)

    path = tmp_path / "rows.jsonl"
    results = harness.Results("bench_x", str(path), command=["bench_x.py", "--json", str(path)])
    results.add("base", timed.seconds("base"), shape="4x8")
    results.add("slow", timed.seconds("slow"), shape="4x8", baseline="base", baseline_seconds=timed.seconds("base"),
                peak_mib=1.5)
    harness.Results("bench_y", str(path), threads=3).add("other", 2.0, config={"k": 2})  # appended, not replaced
    rows = harness.read_rows(str(path))
    assert [(r["benchmark"], r["row"]) for r in rows] == [("bench_x", "base"), ("bench_x", "slow"), ("bench_y", "other")]
    assert all(ROW_KEYS <= set(r) for r in rows)
    assert rows[0]["baseline"] is None and rows[0]["ratio"] is None and rows[0]["shape"] == "4x8"
    assert rows[1]["baseline"] == {"row": "base", "seconds": timed.seconds("base")}
    assert rows[1]["ratio"] == pytest.approx(timed.ratio("slow")) and rows[1]["figures"] == {"peak_mib": 1.5}
    assert rows[2]["config"] == {"k": 2} and "shape" not in rows[2] and rows[2]["machine"]["threads"] == 3
    assert {"platform", "python", "torch", "threads", "device"} <= set(rows[0]["machine"])
    assert rows[0]["command"] == ["bench_x.py", "--json", str(path)] and rows[2]["command"] == sys.argv
    assert datetime.datetime.fromisoformat(rows[0]["date"]).tzinfo is not None


def test_training_step_times_a_baseline_update_alternately_in_the_process():
    """The training-step benchmarks take each row's ratio against baseline updates timed alternately with the
    row's own (training_step.time_updates' ``baseline``), the row's peak read before the baseline exists: the
    order of the updates."""
    from training_step import build_model_and_sample, time_updates, warmup_updates

    cfg = dict(arch="lstm", bsz=2, src_len=3, tgt_len=3, vocab=40, threads=1, device="cpu")
    model, task, sample, device = build_model_and_sample(cfg)
    calls = []

    def criterion_named(name):
        def criterion(model, sample):
            calls.append(name)
            loss = model(**sample["net_input"])[0].float().logsumexp(-1).mean()
            return loss, 1, {}
        return criterion

    def baseline():
        calls.append("built")
        return build_model_and_sample(cfg)[0], criterion_named("tf")

    seconds, _, peak, tf_seconds = time_updates(model, criterion_named("row"), sample, device, 3, 2, baseline)
    assert calls == ["row", "row", "built", "tf", "tf"] + ["tf", "row"] * 3
    assert seconds > 0 and tf_seconds > 0 and peak > 0
    calls.clear()
    assert time_updates(model, criterion_named("row"), sample, device, 2, 1)[3] is None
    assert calls == ["row"] * 3
    assert [warmup_updates(dict(device=d, warmup=w)) for d, w in [("cpu", None), ("cuda:0", None), ("cuda", 2)]] == [
        1, 5, 2]


def test_operator_benchmark_prints_its_table_and_writes_its_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    out = bench("bench_soft_topk.py", "--tables", "authors", "--shapes", "generic", "--repeats", "1",
                "--peer-repeats", "2", "--no-unrolled", "--threads", "1", "--json", path)
    rows = table(out)
    assert len(rows) == 2 and rows[1][0] == "generic 64x1000" and len(rows[1]) == 17, out
    records = {r["row"]: r for r in harness.read_rows(str(path))}
    assert {"ours sorted", "ours sorted torch path", "paper 200it", "torch.topk", "ours unsorted",
            "ours unsorted torch path", "perturbed 10 unsorted", "perturbed 100 unsorted"} <= set(records)
    assert "unrolled 200it" not in records  # --no-unrolled
    assert all(r["shape"] == "generic 64x1000" and r["benchmark"] == "bench_soft_topk" for r in records.values())
    paper, ours = records["paper 200it"], records["ours sorted"]
    assert paper["baseline"]["row"] == "ours sorted" and ours["baseline"] is None
    assert paper["ratio"] == pytest.approx(paper["seconds"] / paper["baseline"]["seconds"])
    assert rows[1][rows[0].index("paper/ours")] == f"{paper['ratio']:.1f}x"  # the table's ratio is the row's
    assert records["perturbed 100 unsorted"]["baseline"]["row"] == "ours unsorted"
    assert 0 < ours["figures"]["max_abs_error"] < 1e-5 and ours["figures"]["bwd_peak_mib"] > 0


def test_soft_beam_benchmark_prints_its_table_and_writes_its_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    # (one teacher-forcing pass: each configuration is a process of its own, and the passes are the criterion's)
    out = bench("bench_soft_beam.py", "--archs", "lstm", "--candidates", "20", "--beam", "2", "--relaxations",
                "soft_topk", "perturbed", "--teacher-forcing-passes", "separate", *BATCH, "--json", path)
    rows = table(out)
    # header, teacher forcing, and per relaxation: sum, rho 0, sample (expected)
    assert len(rows) == 1 + 1 + 2 * 3, out
    assert [r[2] for r in rows[2:]] == ["soft_topk"] * 3 + ["perturbed"] * 3
    assert [r[1] for r in rows[2:5]] == ["soft_beam_search, rho 0.8, sum, teacher forcing separate",
                                         "soft_beam_search, rho 0 (L_SOFT only)",
                                         "soft_beam_search, rho 0.8, sample (expected: rho t_TF + (1-rho) t_SOFT)"]
    records = harness.read_rows(str(path))
    assert [r["row"] for r in records] == [r[1] for r in rows[1:]]
    assert records[0]["row"] == "label_smoothed_cross_entropy" and records[0]["baseline"] is None
    for record, row in zip(records[1:], rows[2:]):
        assert record["baseline"]["row"] == "label_smoothed_cross_entropy" and record["baseline"]["seconds"] > 0
        assert row[5] == f"{record['ratio']:.2f}"  # x teacher forcing: against the row's own baseline updates
        assert record["config"]["relaxation"] == row[2] and record["config"]["candidates"] == 20
    sample, only = records[3], records[2]  # sample mode's expected time: rho t_TF + (1 - rho) t_SOFT
    assert sample["seconds"] == pytest.approx(0.8 * only["baseline"]["seconds"] + 0.2 * only["seconds"])
    assert all(r["machine"]["threads"] == 1 for r in records)


def test_topk_attention_benchmark_prints_its_table_and_writes_its_rows(tmp_path):
    from training_step import ATTENTION_VARIANTS

    path = tmp_path / "rows.jsonl"
    out = bench("bench_topk_attention.py", *BATCH, "--json", path)
    rows = table(out)
    assert [r[0] for r in rows[1:]] == list(ATTENTION_VARIANTS), out
    records = harness.read_rows(str(path))
    assert [r["row"] for r in records] == list(ATTENTION_VARIANTS)
    assert records[0]["baseline"] is None and rows[1][2] == "1.00"
    for record, row in zip(records[1:], rows[2:]):
        assert record["baseline"]["row"] == "transformer (softmax)" and row[2] == f"{record['ratio']:.2f}"
    modes = [r["config"].get("topk_attn_mode") for r in records]
    assert modes == [None, "soft_topk", "hard_topk", "soft_topk", "perturbed"]


def test_user_benchmarks_import_only_the_libraries():
    """benchmarks/ holds the three benchmarks and two libraries; a benchmark imports the libraries, never another
    benchmark."""
    scripts = {"bench_soft_topk.py", "bench_soft_beam.py", "bench_topk_attention.py"}
    assert {f for f in os.listdir(BENCH) if f.endswith(".py")} == scripts | {"harness.py", "training_step.py"}
    for name in scripts | {"training_step.py"}:
        with open(os.path.join(BENCH, name), encoding="utf-8") as f:
            imported = set(re.findall(r"^\s*(?:from|import) (\w+)", f.read(), flags=re.M))
        assert not imported & {s[:-3] for s in scripts}, (name, imported)


def test_operator_benchmark_floor_table_ratios_to_the_hard_topk_and_time_against_n(tmp_path):
    """The floor table times the README's call against the hard top-k's forward and prints the ratio its row
    records, and whether the CPU targets of the shapes it ran are met; the against-n table draws its figure."""
    path, plot = tmp_path / "rows.jsonl", tmp_path / "n.png"
    out = bench("bench_soft_topk.py", "--tables", "floor", "against_n", "--shapes", "generic", "--floor-rounds", "1",
                "--floor-k", "16", "--peers", "budget_bisect", "--against-n", "32", "100", "--plot", plot,
                "--threads", "1", "--json", path)
    rows = table(out)
    assert rows[0][:4] == ["shape", "hard top-k (forward)", "ours unsorted", "/ hard"]
    assert rows[1][0] == "generic 64x1000"
    records = list(harness.read_rows(str(path)))
    floor = {r["row"]: r for r in records if r["figures"]["table"] == "floor" and "k" not in r["figures"]}
    assert set(floor) == {"hard top-k", "ours unsorted", "ours sorted", "budget_bisect",
                          "ours unsorted check_errors=True", "ours unsorted check_errors=False"}, out
    small = floor["ours unsorted check_errors=False"]  # the small call's host cost, without against with checks
    assert small["shape"] == "small 4x16" and small["baseline"]["row"] == "ours unsorted check_errors=True"
    assert (f"target: check_errors=False <= 1.1x check_errors=True at small 4x16: "
            f"{'met' if small['ratio'] <= 1.1 else 'NOT met'} ({small['ratio']:.2f}x)") in out
    ours = floor["ours unsorted"]
    assert ours["baseline"]["row"] == "hard top-k" and rows[1][3] == f"{ours['ratio']:.2f}x"
    assert floor["hard top-k"]["figures"]["pass"] == "forward"
    assert floor["budget_bisect"]["baseline"]["row"] == "ours unsorted"
    assert [r["figures"]["k"] for r in records if "k" in r["figures"]] == [16] and "k = 16" in out
    sorted_ratio = floor["ours sorted"]["ratio"]  # the CPU targets of the shape run, each said met or not
    assert re.search(r"target: ours unsorted <= 3x hard top-k at generic 64x1000: (met|NOT met) \(\d+\.\d\dx\)", out)
    assert (f"target: ours sorted <= 6x ours unsorted at generic 64x1000: {'met' if sorted_ratio <= 6 else 'NOT met'} "
            f"({sorted_ratio:.2f}x)") in out and "attention" not in out.split("target:", 1)[1]
    against = {(r["row"], r["shape"]) for r in records if r["figures"]["table"] == "against_n"}
    assert {("authors' code (sorted)", "64x32"), ("ours unsorted", "64x100"), ("hard top-k", "64x100")} <= against
    assert plot.stat().st_size > 0


def test_operator_benchmark_call_cost_table_ratios_to_the_hard_mask_with_the_gpu_targets(tmp_path):
    """The call-cost table: the hard mask, unsorted with and without check_errors and sorted at each shape asked,
    each ratio recorded against its baseline row and printed with its target (on CPU said to be a GPU target)."""
    path = tmp_path / "rows.jsonl"
    out = bench("bench_soft_topk.py", "--tables", "call_cost", "--call-cost-shapes", "generic", "attention",
                "--call-cost-rounds", "1", "--threads", "1", "--json", path)
    rows = table(out)
    assert [r[0] for r in rows[1:]] == ["generic 64x1000", "attention 7680x32"]
    records = [r for r in harness.read_rows(str(path)) if r["figures"]["table"] == "call_cost"]
    got = {(r["row"], r["shape"]): r for r in records}
    assert set(row for row, _ in got) == {"hard top-k", "unsorted", "unsorted unchecked", "sorted"}
    for shape in ("generic 64x1000", "attention 7680x32"):
        for row, base, bound in (("unsorted unchecked", "hard top-k", 2), ("unsorted", "hard top-k", 3),
                                 ("sorted", "unsorted", 2)):
            r = got[(row, shape)]
            assert r["baseline"]["row"] == base
            assert r["ratio"] == pytest.approx(r["seconds"] / got[(base, shape)]["seconds"])
            assert (f"target: {row} <= {bound}x {base} at {shape}: a GPU target, not checked on CPU "
                    f"({r['ratio']:.2f}x)") in out
