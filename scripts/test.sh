#!/usr/bin/env bash
# Set up .venv on first use, then run the test suite (slow experiments excluded). Extra args go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
set +e
"$root/.venv/bin/python" -m pytest -m "not slow" --durations=15 "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a failure for us, never a pass.
if [[ $rc -eq 5 ]]; then
    echo "scripts/test.sh: pytest collected no tests" >&2
    exit 1
fi
exit $rc
