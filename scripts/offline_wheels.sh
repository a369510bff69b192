#!/usr/bin/env bash
# Wheels of everything softtopk-fairseq needs beside torch, for a machine that has its own torch (and triton)
# but no package index -- a CUDA container, an offline cluster node --, downloaded here for its Python:
#   bash scripts/offline_wheels.sh DIR [PYTHON_VERSION]     (default: this machine's python3, e.g. 3.12)
# (PYTHON=... names the interpreter whose pip downloads; default the .venv, else python3)
# There, from this repository's root: SOFTTOPK_WHEELS=DIR bash scripts/gpu_check.sh [OUTDIR], or by hand
#   python3 -m pip install --no-index --no-deps --target SITE DIR/*.whl; export PYTHONPATH=SITE:$PWD
# The versions are constraints.txt's pins (one place); the packages are KIT below: fairseq-fixed and what it,
# the tokenizers, scoring, the tests and the benchmarks' peers need that a PyTorch image usually lacks. Binary
# wheels are taken for PYTHON_VERSION on manylinux x86-64 (fairseq-fixed 0.12.3.1 has one for CPython 3.12:
# its Cython helpers are built against NumPy 2's C API, its torch extensions are used by models we do not
# load); the pure-Python packages published only as sdists (PURE_SDISTS: antlr4-python3-runtime 4.9.3,
# difftopk 0.2.0) are built into py3-none-any wheels here. Any other package without a wheel for that Python
# fails here, by name, not there (its sdist is not tried: building fairseq's would pull a torch into pip's
# build environment).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[[ $# -ge 1 && $# -le 2 ]] || { echo "usage: bash scripts/offline_wheels.sh DIR [PYTHON_VERSION]" >&2; exit 2; }
dir=$1
py=${PYTHON:-}
if [[ -z $py ]]; then
    py=python3
    [[ -x $root/.venv/bin/python ]] && py=$root/.venv/bin/python
fi
"$py" -m pip --version > /dev/null 2>&1 || { echo "offline_wheels: '$py -m pip' does not run (set PYTHON)" >&2; exit 2; }
version=${2:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
[[ $version =~ ^3\.[0-9]+$ ]] || { echo "offline_wheels: PYTHON_VERSION must look like 3.12, got '$version'" >&2; exit 2; }
KIT=(fairseq-fixed hydra-core omegaconf antlr4-python3-runtime bitarray cffi pycparser sacrebleu portalocker
     tabulate colorama sentencepiece subword-nmt mock sacremoses hypothesis entmax difftopk diffsort)
PURE_SDISTS=" antlr4-python3-runtime difftopk "
mkdir -p "$dir"
pip=("$py" -m pip --disable-pip-version-check -q)
for name in "${KIT[@]}"; do
    pin=$(grep -iE "^${name}==" "$root/constraints.txt" || true)
    [[ -n $pin ]] || { echo "offline_wheels: $name has no pin in constraints.txt" >&2; exit 1; }
    if ! "${pip[@]}" download --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d "$dir" "$pin" 2> /dev/null; then
        if [[ $PURE_SDISTS != *" $name "* ]]; then
            echo "offline_wheels: no wheel of $pin for CPython $version on manylinux x86-64" >&2
            exit 1
        fi
        built=$(mktemp -d)
        "${pip[@]}" wheel --no-deps --no-binary=:all: -w "$built" "$pin" > /dev/null 2>&1 || true
        wheel=$(ls "$built"/*-py3-none-any.whl 2> /dev/null || true)
        if [[ -z $wheel ]]; then
            echo "offline_wheels: $pin: its sdist did not build into a pure-Python wheel" >&2
            rm -rf "$built"
            exit 1
        fi
        mv "$wheel" "$dir/"
        rm -rf "$built"
    fi
done
echo "offline_wheels: ${#KIT[@]} wheels for CPython $version in $dir ($(du -sh "$dir" | cut -f1))"
