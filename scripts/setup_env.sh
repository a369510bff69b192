#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with pinned dependencies.
#
# Order matters: torch first (the local CPU build, pinned so nothing can replace it), then the build
# dependencies, then fairseq-fixed compiled against that torch (--no-build-isolation), then the rest.
# Idempotent: when constraints.txt, setup.cfg and this script are unchanged since the last successful
# run, it returns in well under a second.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${SOFTTOPK_VENV:-$root/.venv}
py=${PYTHON:-python3}
stamp=$venv/.softtopk-setup-stamp
want=$(cat "$root/constraints.txt" "$root/setup.cfg" "$root/pyproject.toml" "$0" | sha256sum | cut -d' ' -f1)

if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    exit 0
fi

log() { printf '[setup_env] %s\n' "$*" >&2; }
start=$(date +%s)
[[ -x $venv/bin/python ]] || { log "creating $venv"; "$py" -m venv "$venv"; }
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q -c "$root/constraints.txt")

log "1/5 torch (CPU build, pinned)"
"${pip[@]}" torch==2.13.0
log "2/5 build dependencies"
"${pip[@]}" setuptools wheel cython numpy
log "3/5 fairseq-fixed (compiles against our torch; a few minutes on first run)"
if ! "$venv/bin/python" -c "import fairseq" 2>/dev/null; then
    "${pip[@]}" --no-build-isolation fairseq-fixed hydra-core omegaconf antlr4-python3-runtime bitarray
fi
log "4/5 tokenizers, scoring, triton, test tools, matplotlib"
"${pip[@]}" sentencepiece subword-nmt sacrebleu sacremoses triton pytest hypothesis matplotlib
log "5/5 softtopk-fairseq (editable)"
"${pip[@]}" --no-build-isolation --no-deps -e "$root"

got=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
[[ $got == 2.13.0* ]] || { log "torch was replaced: $got"; exit 1; }
echo "$want" > "$stamp"
log "done in $(( $(date +%s) - start )) s"
