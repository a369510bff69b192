# Sourced by the recipe's scripts: where the plugin and the Python with fairseq are.
# PYTHON defaults to the repository's .venv (made by scripts/setup_env.sh), else the python on PATH.
RECIPE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$RECIPE_DIR/../.." && pwd)"
USER_DIR="$REPO_ROOT/user_dir"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$REPO_ROOT/.venv/bin/python" ]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python; fi
fi
# fairseq 0.12 drops a last batch smaller than --required-batch-size-multiple (fairseq#5036).
KEEP_LAST_BATCH=(--required-batch-size-multiple 1)

# The calling script's usage: its header comment (line 2 up to the first line that is not a comment), to stderr.
usage() {
    sed -n '2,/^[^#]/{/^#/p}' "$0" >&2
}

need_dir() {
    if [ ! -d "$1" ]; then echo "error: $1 not found ($2)" >&2; exit 2; fi
}

need_file() {
    if [ ! -f "$1" ]; then echo "error: $1 not found ($2)" >&2; exit 2; fi
}

# SRC and TGT of a prepared DEST, from fairseq-preprocess's file names (DEST/bin/valid.SRC-TGT.SRC.idx).
prepared_languages() {
    local idx pair
    idx=$(cd "$1/bin" && ls valid.*-*.*.idx 2>/dev/null | head -n 1)
    if [ -z "$idx" ]; then echo "error: $1/bin has no valid.SRC-TGT.*.idx (run prepare.py first)" >&2; exit 2; fi
    pair=${idx#valid.}; pair=${pair%%.*}
    SRC=${pair%-*}; TGT=${pair#*-}
}
