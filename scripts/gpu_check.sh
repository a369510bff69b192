#!/usr/bin/env bash
# Everything that needs a GPU, in one command, with one summary of the figures:
#   bash scripts/gpu_check.sh [OUTDIR]          (default OUTDIR: work/gpu_check)
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
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
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
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA device visible to $py (torch.cuda.is_available() is False): nothing to check here."
    exit 0
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
summary=$out/summary.md
failed=()
{
    echo "# gpu_check $(date -u +%Y-%m-%dT%H:%MZ)"
    "$py" -c "import torch, triton; p = torch.cuda.get_device_properties(0); print(f'{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}')"
} > "$summary"

section() {  # section NAME COMMAND...: run it, log it, add its tables (or its last lines) to the summary
    local name=$1
    shift
    if [[ -n ${GPU_CHECK_SECTIONS:-} && " $GPU_CHECK_SECTIONS " != *" $name "* ]]; then
        return 0
    fi
    echo "== $name: $*"
    local start=$SECONDS
    "$@" > "$out/$name.log" 2>&1
    local rc=$?
    local took=$((SECONDS - start))
    {
        echo
        echo "## $name (exit $rc, $took s)"
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

section tests "$py" -m pytest -q -m "not slow" -p no:cacheprovider tests/test_fused_kernels.py tests/test_triton.py \
    tests/test_soft_topk_properties.py tests/test_soft_topk.py tests/test_mixed_precision.py tests/test_check_errors.py \
    tests/test_cuda_graphs.py
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
