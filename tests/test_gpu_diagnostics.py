"""The GPU diagnostics (scripts/gpu/, run by scripts/gpu_check.sh), their CPU-runnable parts: each prints its
table at tiny sizes, the checks the phases diagnostic measures are made through a registered relaxation, the
host operations are counted, and the fairseq check's arguments, log reading and exit handling hold (its full CPU
run is marked slow)."""
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.path.join(REPO, "scripts", "gpu")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
sys.path.insert(0, GPU)


def script(name, *args, timeout=600):
    out = subprocess.run([sys.executable, os.path.join(GPU, name), *map(str, args)], capture_output=True, text=True,
                         timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def table(stdout):
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in stdout.splitlines()
            if line.startswith("| ") and "---" not in line]


def test_phases_diagnostic_makes_soft_topks_checks_through_a_registered_relaxation():
    """soft_beam_phases.py measures the cost of soft_topk's checks with its own relaxation, ``soft_topk_checked``
    (registered, selected by name): a soft beam search on the Triton backend (under the interpreter here) reads
    back two values per step with it -- the status bits and the iteration counts -- and one per search with the
    search's own ``soft_topk`` (the empty-target check), which it leaves as it was; the criterion selects it from
    its config as the diagnostic builds it; and the diagnostic's table on CPU."""
    import torch
    from host_reads import HostReads
    from soft_beam_phases import CheckedSoftTopK
    from tiny_models import batch, build, dictionary
    from training_step import build_model_and_sample, update_criterion

    from softtopk_fairseq.modules import relaxations
    from softtopk_fairseq.modules.soft_beam_search import soft_beam_search
    from softtopk_fairseq.ops import use_backend

    assert CheckedSoftTopK.name in relaxations.names("search") and CheckedSoftTopK.check_errors
    d = dictionary(12)
    model, sample = build("lstm", d, dtype=torch.float32), batch(d, tgt_lens=(5, 4, 6))
    ni = sample["net_input"]
    encoder_out = model.encoder(ni["src_tokens"], src_lengths=ni["src_lengths"])  # (it reads the padding: fairseq's)

    def reads(relaxation):
        with use_backend("triton"), HostReads() as mode:
            soft_beam_search(model, ni["src_tokens"], ni["src_lengths"], sample["target"], pad=d.pad(), eos=d.eos(),
                             beam=3, scaling="paper", encoder_out=encoder_out, relaxation=relaxation)
        return mode.count

    assert reads(CheckedSoftTopK.name) >= 1 + 2 * 5  # 6 steps, the last without a relaxed top-k (+1 at max_iter)
    assert reads("soft_topk") == 1 and not relaxations.OptimalTransport.check_errors

    cfg = dict(arch="lstm", bsz=2, src_len=3, tgt_len=4, vocab=40, threads=1, device="cpu")
    model, task, sample, _ = build_model_and_sample(cfg)
    counted = {}
    for name in ("soft_topk", CheckedSoftTopK.name):
        criterion = update_criterion("sum", task, name)
        assert criterion.search_options["relaxation"] == name
        with use_backend("triton"), HostReads() as mode:
            criterion(model, sample)
        counted[name] = mode.count
    assert counted[CheckedSoftTopK.name] >= counted["soft_topk"] + 2 * 3  # 4 target tokens: 3 relaxed steps

    rows = table(script("soft_beam_phases.py", "--bsz", "2", "--src-len", "3", "--tgt-len", "3", "--vocab", "40",
                        "--repeats", "1", "--threads", "1"))
    assert [row[0] for row in rows] == ["update", "teacher forcing", "sum", "sum, checks made", "sum, CUDA graphs"]
    assert all(float(cell) > 0 for row in rows[1:] for cell in row[1:5]), rows  # the phases and the total


def test_graph_batches_diagnostic_prints_one_row_per_epoch():
    rows = table(script("soft_beam_graph_batches.py", "--batches", "2", "--epochs", "2", "--bsz-choices", "2", "3",
                        "--src-lens", "3", "4", "--tgt-lens", "3", "4", "--vocab", "40", "--threads", "1"))
    assert [r[0] for r in rows] == ["epoch", "1", "2"], rows
    assert all(float(cell) > 0 for r in rows[1:] for cell in r[1:6]), rows
    assert all(r[6] == "0" for r in rows[1:]), rows  # on CPU nothing is captured


def test_profile_diagnostic_counts_synchronisations():
    out = script("profile_soft_beam.py", "--bsz", "4", "--src-len", "5", "--tgt-len", "4", "--vocab", "60",
                 "--threads", "1", "--rows", "5")
    assert "Self CPU time total" in out
    # Adam's reads of its CPU step counters (one per parameter tensor on CPU) are told apart from the update's own.
    reported = re.search(r"host-device synchronisations per update: (\d+) \((\d+) scalar reads, less the optimizer "
                         r"step's (\d+) ", out)
    assert reported, out
    syncs, reads, step_reads = map(int, reported.groups())
    assert step_reads > 0 and syncs == reads - step_reads > 0


def test_count_host_ops_breaks_a_soft_beam_update_down_by_source():
    out = script("count_host_ops.py", "--soft-beam", "--backend", "cpu", "--top", "40", "--tgt-len", "5")
    assert "lengths 6 / 5" in out
    total = int(re.search(r"backend cpu: (\d+) tensor operations", out).group(1))
    tf_ops = int(re.search(r"teacher forcing on the same batch: (\d+) operations", out).group(1))
    assert 0 < tf_ops < total  # the search costs more than teacher forcing on its own
    rows = {r[1].strip(): int(r[2]) for r in (line.split("|") for line in out.splitlines())
            if len(r) == 4 and r[2].strip().isdigit()}
    # the decoder steps, the relaxed top-k and PyTorch's own backward all show up, and they add up; the backward
    # by operator too (its gradient accumulation among them), within the engine's total
    assert {"soft_beam_search.py:soft_beam_search", "soft_topk.py:soft_topk", "autograd engine"} <= set(rows)
    sources = {k: v for k, v in rows.items() if not k.startswith("aten.")}
    engine = {k: v for k, v in rows.items() if k.startswith("aten.")}
    assert sum(sources.values()) <= total and min(sources.values()) > 0
    assert "aten.add.Tensor" in engine and sum(engine.values()) <= sources["autograd engine"]


def test_count_host_ops_counts_a_topk_attention_training_step():
    out = script("count_host_ops.py", "--topk-attention", "--backend", "cpu")
    rows = {r[1].strip(): (int(r[2]), int(r[3])) for r in (line.split("|") for line in out.splitlines())
            if len(r) == 5 and r[2].strip().isdigit()}
    assert set(rows) == {"transformer (softmax)", "transformer_topk_attn soft_topk, all three"}
    # six soft_topk calls and their surroundings come on top of the same transformer's operations
    assert rows["transformer_topk_attn soft_topk, all three"][0] > rows["transformer (softmax)"][0]


def test_count_host_ops_prints_its_table():
    rows = [line.split("|") for line in script("count_host_ops.py", "--rows", "3", "--n", "12").splitlines()
            if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) >= 8
    counts = {(r[1].strip(), r[2].strip(), r[3].strip()): int(r[4]) for r in rows}
    assert all(0 < int(r[4]) <= int(r[5]) for r in rows)  # views left out, then counted too
    # the fused unsorted call is a handful of host operations (one kernel each way), the PyTorch path's hundreds
    for backend in ("cpu", "triton") if ("triton", "paper", "unsorted") in counts else ("cpu",):
        assert counts[(backend, "paper", "unsorted")] < counts[("torch", "paper", "unsorted")] / 5


def test_gpu_diagnostics_import_libraries_not_each_other():
    """scripts/gpu/ holds scripts only; they import benchmarks/harness.py and training_step.py, not each other and
    not the benchmarks."""
    names = {os.path.splitext(n)[0] for n in os.listdir(GPU) if n.endswith(".py")}
    assert names == {"gpu_train_check", "soft_beam_phases", "soft_beam_graph_batches", "triton_tuning",
                     "profile_soft_beam", "count_host_ops"}
    forbidden = names | {"bench_soft_topk", "bench_soft_beam", "bench_topk_attention"}
    for name in names:
        with open(os.path.join(GPU, name + ".py"), encoding="utf-8") as f:
            imported = set(re.findall(r"^\s*(?:from|import) (\w+)", f.read(), flags=re.M))
        assert not imported & forbidden, (name, imported & forbidden)


def test_gpu_train_check_runs_fairseq_with_the_plugins_current_flags():
    """The fairseq check's training arguments parse with the plugin's flags of this version: the soft beam-search
    fine-tuning and the top-k attention model as it trains them."""
    from fairseq import options
    from gpu_train_check import PRECISION_FLAGS, SOFT_BEAM, TF, TOPK_ATTN

    from softtopk_fairseq.pipeline.run import ARCH_ARGS, USER_DIR

    def parsed(*extra):
        return options.parse_args_and_arch(options.get_training_parser(), [
            "data", "--user-dir", USER_DIR, *ARCH_ARGS["transformer"]["tiny"], *extra])

    soft = parsed(*SOFT_BEAM, *PRECISION_FLAGS["fp16"])
    assert (soft.criterion, str(soft.soft_beam_relaxation), soft.soft_beam_epsilon, str(soft.soft_beam_scaling),
            soft.soft_beam_candidates, soft.teacher_forcing_ratio, soft.fp16) == (
        "soft_beam_search", "soft_topk", 0.1, "paper", 50, 0.8, True)
    assert soft.soft_topk_epsilon is None and soft.soft_topk_scaling is None  # no old names
    attention = parsed(*TOPK_ATTN, *TF, *PRECISION_FLAGS["amp"])
    assert (attention.arch, str(attention.topk_attn_mode), attention.topk_attn_k, attention.criterion,
            attention.amp) == ("transformer_topk_attn", "soft_topk", 4, "label_smoothed_cross_entropy", True)


def test_gpu_train_check_reads_fairseqs_json_log():
    from gpu_train_check import train_stats

    log = ("2026-11-24 10:00:00 | INFO | train_inner | {\"epoch\": 1, \"loss\": \"7.1\", \"gnorm\": \"2.0\", "
           "\"ups\": \"3.1\"}\n"
           "2026-11-24 10:00:01 | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring gradient\n"
           "2026-11-24 10:00:02 | INFO | train_inner | {\"epoch\": 1, \"loss\": \"nan\", \"soft_loss\": \"6.0\", "
           "\"ups\": \"3.5\"}\n"
           "2026-11-24 10:00:03 | INFO | train | {\"epoch\": 1, \"loss\": \"6.5\", \"tf_loss\": \"inf\"}\n"
           "not a record {\"loss\": oops}\n")
    stats = train_stats(log)
    assert stats["records"] == 3 and stats["final_loss"] == 6.5 and stats["ups"] == 3.5
    assert stats["non_finite"] == 2 and stats["overflows"] == 1  # the nan loss, the inf tf_loss
    assert train_stats("")["records"] == 0


def test_gpu_train_check_counts_an_abort_after_done_training_as_finished_and_any_other_failure_not(tmp_path):
    """Some GPU images abort every fairseq-train at interpreter exit, after its work is saved: that exit is
    reported (returned, for the table), not a failure; an abort before the marker, or any non-zero exit
    without it, still fails."""
    import gpu_train_check

    marker = gpu_train_check.DONE_TRAINING
    log = str(tmp_path / "run.log")
    finished = [sys.executable, "-c", f"import os; print('{marker} 1.0 seconds', flush=True); os.abort()"]
    output, _, abort = gpu_train_check.run(finished, log, done_marker=marker)
    assert marker in output and abort == f"SIGABRT after {marker!r}"
    assert gpu_train_check.run([sys.executable, "-c", "print('ok')"], log, done_marker=marker)[2] is None
    with pytest.raises(RuntimeError, match="failed"):
        gpu_train_check.run([sys.executable, "-c", "import os; print('epoch 1', flush=True); os.abort()"], log,
                            done_marker=marker)
    with pytest.raises(RuntimeError, match=r"failed \(3\)"):  # an ordinary error exit, marker or not
        gpu_train_check.run([sys.executable, "-c", f"print('{marker}'); raise SystemExit(3)"], log,
                            done_marker=marker)
    with pytest.raises(RuntimeError, match="failed"):  # run without a shell: status 134 is an exit, not SIGABRT
        gpu_train_check.run([sys.executable, "-c", f"print('{marker}'); raise SystemExit(134)"], log,
                            done_marker=marker)
    with pytest.raises(RuntimeError, match="failed"):  # without a marker (generate) every abort fails
        gpu_train_check.run(finished, log)


@pytest.mark.slow
def test_gpu_train_check_runs_on_cpu_in_full_precision(tmp_path):
    """The fairseq part of gpu_check.sh, tiny and on CPU (fairseq's --bf16 means a TPU without CUDA)."""
    rows = table(script("gpu_train_check.py", "--workdir", tmp_path, "--precisions", "none", "--cpu", "--size",
                        "tiny", "--updates", "8", "--finetune-updates", "2", "--train-pairs", "100"))
    assert [r[0] for r in rows[1:]] == ["teacher_forcing", "soft_beam_search", "soft_beam_search, CUDA graphs",
                                        "topk_attn"]
    assert all("(200 hyps)" in r[8] for r in rows[1:])  # every test sentence decoded


@pytest.mark.parametrize("quick", [False, True])
def test_gpu_check_without_cuda_says_so_and_exits_0(tmp_path, quick):
    if __import__("torch").cuda.is_available():
        pytest.skip("a CUDA device is present: gpu_check.sh would run everything")
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), *(["--quick"] if quick else []),
                          str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, SOFTTOPK_PYTHON=sys.executable))
    assert out.returncode == 0 and "no CUDA device" in out.stdout, out.stdout + out.stderr


OUTCOME_TESTS = """
import time, pytest

def test_passes():
    pass

def test_fails():
    assert 1 + 1 == 3, "arithmetic"

def test_skips():
    pytest.skip("not here")

def test_outlives_the_budget():
    time.sleep(600)
"""


def test_quick_gpu_check_stops_a_section_at_its_budget_and_keeps_each_tests_outcome(tmp_path):
    """``gpu_check.sh --quick``'s machinery, on CPU (GPU_CHECK_ON_CPU): the tests section is stopped at its budget
    by a test that outlives it, and what ended before is in OUTDIR/tests.jsonl (each test as it ended: outcome, the
    failure's message) and in the summary's tally, which names the failed test."""
    tests = tmp_path / "test_outcomes_demo.py"
    tests.write_text(OUTCOME_TESTS)
    out = tmp_path / "out"
    run = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), "--quick", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env=dict(os.environ, SOFTTOPK_PYTHON=sys.executable, GPU_CHECK_ON_CPU="1",
                                  GPU_CHECK_SECTIONS="tests", GPU_CHECK_TESTS=str(tests), GPU_CHECK_WORKERS="0",
                                  GPU_CHECK_BUDGET_TESTS="30"))
    assert run.returncode == 1, run.stdout + run.stderr  # the tests section did not finish
    outcomes = {json.loads(line)["test"].split("::")[-1]: json.loads(line)
                for line in (out / "tests.jsonl").read_text().splitlines()}
    assert {name: o["outcome"] for name, o in outcomes.items()} == \
        {"test_passes": "passed", "test_fails": "failed", "test_skips": "skipped"}, outcomes
    assert "arithmetic" in outcomes["test_fails"]["message"] and "not here" in outcomes["test_skips"]["message"]
    summary = (out / "summary.md").read_text()
    assert "stopped at its 30 s budget" in summary and "tests ended: 3 (1 failed, 1 passed, 1 skipped)" in summary
    assert re.search(r"- FAILED \S+::test_fails: .*arithmetic", summary), summary


def test_gpu_check_runs_every_diagnostic_and_benchmark_by_its_path():
    """Every script gpu_check.sh names exists, and every GPU diagnostic is one of its sections."""
    with open(os.path.join(REPO, "scripts", "gpu_check.sh"), encoding="utf-8") as f:
        text = f.read()
    named = set(re.findall(r'"\$py" ((?:benchmarks|experiments|scripts)/[\w/]+\.py)', text))
    assert named and all(os.path.exists(os.path.join(REPO, path)) for path in named), named
    assert {f"scripts/gpu/{n}" for n in os.listdir(GPU) if n.endswith(".py") and n != "count_host_ops.py"} <= named
