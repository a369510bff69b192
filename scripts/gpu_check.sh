#!/usr/bin/env bash
# Everything that needs a GPU, in one command, with one summary of the figures:
#   bash scripts/gpu_check.sh [--quick] [OUTDIR]          (default OUTDIR: work/gpu_check)
# --quick: for a short time on a GPU, at most 6 minutes of wall time from a bare start (the wheels' install included):
#   every CUDA test, the operator's call cost at training sizes against the hard top-k with its targets
#   (bench_soft_topk.py --tables call_cost), and a few fp16 fairseq-train updates of soft_beam_search and
#   transformer_topk_attn -- each section stopped at its budget (QUICK_BUDGET_S below), whatever it left written
#   kept. In both modes each test's outcome is appended to OUTDIR/tests.jsonl the moment it ends (tests/outcomes.py:
#   name, outcome, the error's first lines), each benchmark row to OUTDIR/benchmarks.jsonl, and the summary tallies
#   the tests from that file, so that a run stopped by a limit still says which tests failed.
# 1. the tests that exercise CUDA (Triton kernels against the PyTorch path, property tests through Triton,
#    mixed precision on CUDA), 2. the GPU sections of the benchmarks (benchmarks/: the operator -- Triton vs our
#    PyTorch path and the paper's code --, soft beam-search update cost against teacher forcing, top-k attention
#    step cost), of the unsorted operator from k = 5 to n - 1 (experiments/unsorted_any_k.py) and the GPU
#    diagnostics (scripts/gpu/: Triton launch parameters; the soft beam-search update's profile, its phases and
#    kernel launches, its step's CUDA graphs over batches of varying sizes), 3. a short fairseq-train with
#    soft_beam_search and with transformer_topk_attn in fp16 (amp briefly; fairseq 0.12's --bf16 means a TPU),
#    then fairseq-generate (scripts/gpu/gpu_train_check.py).
# Each section's full output goes to OUTDIR/<section>.log; OUTDIR/summary.md collects the tables and the
# test totals, and is printed at the end; the benchmarks' rows also go to OUTDIR/benchmarks.jsonl (--json). Without
# a CUDA device it says so and exits 0.
# GPU_CHECK_SECTIONS="tests train ..." runs only the named sections (default: all, in the order below).
# The interpreter: SOFTTOPK_PYTHON if set (an environment with CUDA torch, triton, fairseq and this package),
# else the project's .venv, set up by scripts/setup_env.sh (which installs the CUDA build of torch when an
# NVIDIA GPU is present). Without a package index (a CUDA container, an offline node): SOFTTOPK_WHEELS=DIR,
# the wheels of scripts/offline_wheels.sh made elsewhere for this Python, installs them into OUTDIR/site for
# the interpreter's own torch (SOFTTOPK_PYTHON, default python3), this repository on PYTHONPATH, and stops
# here if a requirement of theirs is still missing.
# GPU_CHECK_TESTS="FILE ..." replaces the tests section's files; GPU_CHECK_WORKERS its pytest-xdist processes
# (default 6); GPU_CHECK_BUDGET_<SECTION>=SECONDS a --quick section's budget. GPU_CHECK_ON_CPU=1 runs the sections
# without a CUDA device (the project's tests of this script's own machinery, on CPU).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
quick=0
if [[ ${1:-} == --quick ]]; then
    quick=1
    shift
fi
# --quick's wall-time budget of each section, in seconds (with the wheels' install, at most 6 minutes in all).
declare -A QUICK_BUDGET_S=([tests]=170 [call_cost]=45 [train]=90)
out=$(mkdir -p "${1:-$root/work/gpu_check}" && cd "${1:-$root/work/gpu_check}" && pwd)
if [[ -n ${SOFTTOPK_WHEELS:-} ]]; then
    py=${SOFTTOPK_PYTHON:-python3}
    rm -rf "$out/site"
    "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --target "$out/site" \
        "$SOFTTOPK_WHEELS"/*.whl || { echo "gpu_check: installing the wheels of $SOFTTOPK_WHEELS failed"; exit 1; }
    export PYTHONPATH=$out/site:$root${PYTHONPATH:+:$PYTHONPATH}
    # pip check over the whole environment; only our wheels' own unmet requirements stop the run.
    ours=$(cd "$out/site" && ls -d *.dist-info | sed 's/-[^-]*\.dist-info$//; s/_/-/g' | paste -sd'|')
    missing=$("$py" -m pip check 2>&1 | grep -iE "^($ours) " | grep -i "not installed" || true)
    if [[ -n $missing ]]; then
        echo "gpu_check: the wheels of $SOFTTOPK_WHEELS need what $py does not have:"
        echo "$missing"
        exit 1
    fi
elif [[ -n ${SOFTTOPK_PYTHON:-} ]]; then
    py=$SOFTTOPK_PYTHON
else
    bash "$root/scripts/setup_env.sh" || exit 1
    py=$root/.venv/bin/python
fi
cd "$root"
if [[ -z ${GPU_CHECK_ON_CPU:-} ]] && ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA device visible to $py (torch.cuda.is_available() is False): nothing to check here."
    exit 0
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
summary=$out/summary.md
failed=()
rm -f "$out/tests.jsonl"
{
    echo "# gpu_check$([[ $quick == 1 ]] && echo ' --quick') $(date -u +%Y-%m-%dT%H:%MZ)"
    "$py" -c "import torch, triton; p = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None; print(f'{p.name if p else \"no CUDA device\"}, {p.total_memory / 2**30 if p else 0:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}')"
} > "$summary"

section() {  # section NAME COMMAND...: run it, log it, add its tables (or its last lines) to the summary
    local name=$1
    shift
    if [[ -n ${GPU_CHECK_SECTIONS:-} && " $GPU_CHECK_SECTIONS " != *" $name "* ]]; then
        return 0
    fi
    echo "== $name: $*"
    local start=$SECONDS budget=""
    if [[ $quick == 1 ]]; then
        local var=GPU_CHECK_BUDGET_${name^^}
        budget=${!var:-${QUICK_BUDGET_S[$name]}}
        timeout -k 10 "$budget" "$@" > "$out/$name.log" 2>&1
    else
        "$@" > "$out/$name.log" 2>&1
    fi
    local rc=$?
    local took=$((SECONDS - start))
    local stopped=""
    [[ -n $budget && ($rc -eq 124 || $rc -eq 137) ]] && stopped=", stopped at its ${budget} s budget"
    {
        echo
        echo "## $name (exit $rc, $took s$stopped)"
        echo '`'"$*"'`'
        echo
        if grep -qE '^\|' "$out/$name.log"; then
            grep -E '^\||^[A-Za-z].*(ms|GPU|batch|threads|synchronisations)' "$out/$name.log" | grep -v '^INFO' | head -80
        else
            tail -n 15 "$out/$name.log"
        fi
    } >> "$summary"
    echo "   exit $rc in $took s"
    [[ $rc -eq 0 ]] || failed+=("$name")
}

tests_outcomes() {  # the tests' tally and failures from OUTDIR/tests.jsonl, however the run ended
    "$py" - "$out/tests.jsonl" <<'PY'
import collections, json, os, sys
rows = [json.loads(line) for line in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
count = collections.Counter(row["outcome"] for row in rows)
print(f"\ntests ended: {len(rows)} ({', '.join(f'{n} {o}' for o, n in sorted(count.items())) or 'none'})")
for row in rows:
    if row["outcome"] in ("failed", "error"):
        print(f"- {row['outcome'].upper()} {row['test']}: " + row.get("message", "").replace("\n", " | ")[:400])
PY
}

# (GPU_CHECK_TESTS: word-split on purpose, a list of files)
# shellcheck disable=SC2086
section tests env PYTHONPATH="$root/tests${PYTHONPATH:+:$PYTHONPATH}" "$py" -m pytest -q -m "not slow" -p no:cacheprovider \
    -p outcomes --outcomes "$out/tests.jsonl" \
    -n "${GPU_CHECK_WORKERS:-6}" ${GPU_CHECK_TESTS:-tests/test_fused_kernels.py tests/test_triton.py \
    tests/test_soft_topk_properties.py tests/test_soft_topk.py tests/test_mixed_precision.py tests/test_check_errors.py \
    tests/test_cuda_graphs.py}
tests_outcomes >> "$summary"
if [[ $quick == 1 ]]; then
    section call_cost "$py" benchmarks/bench_soft_topk.py --device cuda --tables call_cost --call-cost-rounds 10 \
        --json "$out/benchmarks.jsonl"
    section train "$py" scripts/gpu/gpu_train_check.py --workdir "$out/train" --precisions fp16 --updates 60 \
        --finetune-updates 10 --short-updates 10 --train-pairs 1000
    echo
    cat "$summary"
    [[ ${#failed[@]} -eq 0 ]] || { echo "gpu_check --quick: failed sections: ${failed[*]} (logs in $out)"; exit 1; }
    echo "gpu_check --quick: all sections passed (logs in $out)"
    exit 0
fi
section call_cost "$py" benchmarks/bench_soft_topk.py --device cuda --tables call_cost --json "$out/benchmarks.jsonl"
section bench_soft_topk "$py" benchmarks/bench_soft_topk.py --device cuda --repeats 10 --json "$out/benchmarks.jsonl"
section unsorted_any_k "$py" experiments/unsorted_any_k.py --device cuda --json "$out/benchmarks.jsonl"
section triton_tuning "$py" scripts/gpu/triton_tuning.py --repeats 10
section bench_soft_beam "$py" benchmarks/bench_soft_beam.py --device cuda --threads 8 --repeats 10 --candidates 50 0 \
    --json "$out/benchmarks.jsonl"
section profile_soft_beam "$py" scripts/gpu/profile_soft_beam.py --device cuda --threads 8
section soft_beam_phases "$py" scripts/gpu/soft_beam_phases.py --device cuda --threads 8
section soft_beam_graph_batches "$py" scripts/gpu/soft_beam_graph_batches.py --device cuda --threads 8
section bench_topk_attention "$py" benchmarks/bench_topk_attention.py --device cuda --threads 8 --repeats 10 \
    --json "$out/benchmarks.jsonl"
section train "$py" scripts/gpu/gpu_train_check.py --workdir "$out/train"

echo
cat "$summary"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "gpu_check: failed sections: ${failed[*]} (logs in $out)"
    exit 1
fi
echo "gpu_check: all sections passed (logs in $out)"
