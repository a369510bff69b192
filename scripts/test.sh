#!/usr/bin/env bash
# Set up .venv on first use, then run the test suite (slow experiments excluded). Extra args go to pytest.
# Without extra args, then also the plugin at the lowest versions it declares (scripts/test_lowest.sh, its own
# .venv-lowest; SOFTTOPK_SKIP_LOWEST=1 leaves it out).
#
# The tests run in SOFTTOPK_TEST_WORKERS processes (pytest-xdist; default: one per CPU core), each test file
# whole in one of them, so that a file's module-scoped fixtures are built once; `-n 0` as an extra argument
# runs everything in this process.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
set +e
"$root/.venv/bin/python" -m pytest -m "not slow" -n "${SOFTTOPK_TEST_WORKERS:-auto}" --dist loadfile --durations=15 "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a failure for us, never a pass.
if [[ $rc -eq 5 ]]; then
    echo "scripts/test.sh: pytest collected no tests" >&2
    exit 1
fi
if [[ $# -eq 0 && -z ${SOFTTOPK_SKIP_LOWEST:-} ]]; then
    echo "scripts/test.sh: the lowest supported versions (scripts/test_lowest.sh)"
    bash "$root/scripts/test_lowest.sh" -q || rc=1
fi
exit $rc
