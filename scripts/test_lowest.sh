#!/usr/bin/env bash
# The plugin at the lowest versions it declares (constraints-lowest.txt: torch 2.4.1, numpy 1.26.4, fairseq-fixed
# 0.12.3.1), in its own virtual environment, .venv-lowest (made on first use, a few minutes: torch 2.4.1 is the CUDA
# build, fairseq-fixed compiles against it): the plugin's import, the operator's tests and fairseq-train +
# fairseq-generate through --user-dir (tests/lowest_versions.txt lists the test files). Extra args go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${SOFTTOPK_LOWEST_VENV:-$root/.venv-lowest}
constraints=$root/constraints-lowest.txt
stamp=$venv/.softtopk-setup-stamp
want=$( (cat "$constraints" "$root/pyproject.toml" "$0") | sha256sum | cut -d' ' -f1)
log() { printf '[test_lowest] %s\n' "$*" >&2; }
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
    start=$(date +%s)
    [[ -x $venv/bin/python ]] || { log "creating $venv"; "${PYTHON:-python3}" -m venv "$venv"; }
    pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q -c "$constraints")
    log "torch and numpy at their floors"
    "${pip[@]}" torch numpy setuptools wheel cython
    log "fairseq-fixed (compiled against them)"
    "$venv/bin/python" -c "import fairseq" 2>/dev/null || "${pip[@]}" --no-build-isolation fairseq-fixed hydra-core \
        omegaconf antlr4-python3-runtime bitarray
    log "tokenizers, scoring, test tools; softtopk-fairseq (editable)"
    "${pip[@]}" sacrebleu sacremoses sentencepiece subword-nmt pytest pytest-xdist hypothesis matplotlib
    "${pip[@]}" --no-build-isolation --no-deps -e "$root"
    "$venv/bin/python" - "$constraints" <<'PY'
import sys, numpy, torch
pins = dict(line.split("==") for line in open(sys.argv[1]) if "==" in line and not line.startswith("#"))
got = {"torch": torch.__version__.split("+")[0], "numpy": numpy.__version__}
wrong = {name: version for name, version in got.items() if version != pins[name].strip()}
sys.exit(f"test_lowest: installed {wrong}, not the pins of {sys.argv[1]}" if wrong else 0)
PY
    echo "$want" > "$stamp"
    log "set up in $(( $(date +%s) - start )) s"
fi
cd "$root"
"$venv/bin/python" -c "import softtopk_fairseq.fairseq_plugin, numpy, torch; print(f'plugin imported: torch {torch.__version__}, numpy {numpy.__version__}')"
set +e
"$venv/bin/python" -m pytest -m "not slow" -n "${SOFTTOPK_TEST_WORKERS:-auto}" --dist loadfile -p no:cacheprovider \
    $(grep -v '^#' tests/lowest_versions.txt) "$@"
rc=$?
set -e
[[ $rc -ne 5 ]] || { echo "test_lowest: pytest collected no tests" >&2; exit 1; }
exit $rc
