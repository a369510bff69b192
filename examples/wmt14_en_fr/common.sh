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

need_dir() {
    if [ ! -d "$1" ]; then echo "error: $1 not found ($2)" >&2; exit 2; fi
}
