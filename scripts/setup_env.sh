#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with pinned dependencies.
#
# Order matters: torch first (pinned so nothing can replace it), then the build dependencies, then
# fairseq-fixed compiled against that torch (--no-build-isolation), then the rest.
#
# Which torch build: SOFTTOPK_TORCH=cpu|cuda|auto (default auto: cuda when `nvidia-smi -L` lists a GPU).
# - cpu: torch==2.13.0 as the package index serves it, with triton pinned in constraints.txt (used only by the
#   Triton interpreter in the tests); where that is PyPI's Linux wheel -- the CUDA build, whose own triton pin
#   conflicts with ours -- from PyTorch's CPU wheel index (CPU_INDEX below) instead.
# - cuda: PyPI's torch==2.13.0 Linux wheel, which is the CUDA 13 build, and the triton it requires
#   (constraints-cuda.txt overrides the pins that differ). Set-up fails if the installed torch then has no CUDA.
# SOFTTOPK_TORCH_INDEX=URL takes torch from that wheel index, for either build (e.g. a PyTorch wheel index for
# another CUDA version).
# SOFTTOPK_SETUP_PLAN=1 prints the chosen build and the effective pins, and installs nothing.
# Idempotent: when the constraints, pyproject.toml, this script and the chosen build are unchanged since the last
# successful run, it returns in well under a second.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${SOFTTOPK_VENV:-$root/.venv}
py=${PYTHON:-python3}
stamp=$venv/.softtopk-setup-stamp
flavour=${SOFTTOPK_TORCH:-auto}
CPU_INDEX=https://download.pytorch.org/whl/cpu
if [[ $flavour == auto ]]; then
    if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
        flavour=cuda
    else
        flavour=cpu
    fi
fi
[[ $flavour == cpu || $flavour == cuda ]] || { echo "setup_env: SOFTTOPK_TORCH must be cpu, cuda or auto, got '$flavour'" >&2; exit 2; }
constraints=$root/constraints.txt
if [[ $flavour == cuda ]]; then
    # constraints.txt minus the packages that constraints-cuda.txt pins differently, plus those pins.
    constraints=$(mktemp)
    trap 'rm -f "$constraints"' EXIT
    overridden=$(sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' "$root/constraints-cuda.txt" | paste -sd'|')
    { grep -vE "^($overridden)==" "$root/constraints.txt"; grep -E '==' "$root/constraints-cuda.txt"; } > "$constraints"
fi
if [[ -n ${SOFTTOPK_SETUP_PLAN:-} ]]; then  # say what would be installed, install nothing
    index=""
    [[ -n ${SOFTTOPK_TORCH_INDEX:-} ]] && index=" (index $SOFTTOPK_TORCH_INDEX)"
    echo "torch build: $flavour$index"
    echo "constraints:"
    grep -E '==' "$constraints"
    exit 0
fi
want=$( (cat "$root/constraints.txt" "$root/constraints-cuda.txt" "$root/pyproject.toml" "$0";
         echo "$flavour ${SOFTTOPK_TORCH_INDEX:-}") | sha256sum | cut -d' ' -f1)

if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    exit 0
fi

log() { printf '[setup_env] %s\n' "$*" >&2; }
start=$(date +%s)
if [[ ! -x $venv/bin/python ]]; then
    "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || {
        log "Python >= 3.11 is needed; $py is $("$py" --version 2>&1 || echo missing): set PYTHON=python3.11"; exit 2; }
    log "creating $venv"
    "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q -c "$constraints")

log "1/5 torch 2.13.0 ($flavour build, pinned)"
if [[ -n ${SOFTTOPK_TORCH_INDEX:-} ]]; then
    "${pip[@]}" --index-url "$SOFTTOPK_TORCH_INDEX" torch==2.13.0
elif ! "${pip[@]}" torch==2.13.0; then
    [[ $flavour == cpu ]] || exit 1
    log "the package index serves no CPU build of torch 2.13.0 (PyPI's Linux wheel is the CUDA one): taking it"
    log "from $CPU_INDEX (SOFTTOPK_TORCH_INDEX=URL names another)"
    "${pip[@]}" --index-url "$CPU_INDEX" torch==2.13.0
fi
log "2/5 build dependencies"
"${pip[@]}" setuptools wheel cython numpy
log "3/5 fairseq-fixed (compiles against our torch; a few minutes on first run)"
if ! "$venv/bin/python" -c "import fairseq" 2>/dev/null; then
    "${pip[@]}" --no-build-isolation fairseq-fixed hydra-core omegaconf antlr4-python3-runtime bitarray
fi
log "4/5 tokenizers, scoring, triton, test tools, matplotlib, entmax and difftopk (benchmark peers), scikit-learn (its digits)"
"${pip[@]}" sentencepiece subword-nmt sacrebleu sacremoses triton pytest pytest-xdist hypothesis matplotlib entmax difftopk scikit-learn
log "5/5 softtopk-fairseq (editable)"
"${pip[@]}" --no-build-isolation --no-deps -e "$root"

got=$("$venv/bin/python" -c "import torch; print(torch.__version__, torch.version.cuda)")
[[ $got == 2.13.0* ]] || { log "torch was replaced: $got"; exit 1; }
if [[ $flavour == cuda && $got == *" None" ]]; then
    log "SOFTTOPK_TORCH=cuda but the installed torch has no CUDA ($got): a CPU wheel was preferred (a local"
    log "wheel directory?); set SOFTTOPK_TORCH_INDEX to a CUDA wheel index"
    exit 1
fi
echo "$want" > "$stamp"
log "done in $(( $(date +%s) - start )) s"
