#!/usr/bin/env bash
# The converged study's runs in the background on this machine: niced, resumable, from a snapshot of the committed
# code (an edit to the checkout does not reach a run in flight), the ledger and what is kept beside it in the checkout.
#
#   bash experiments/multi30k_converged/background.sh start [WORK]   # start, or continue after a stop
#   bash experiments/multi30k_converged/background.sh pause|resume [WORK]
#   bash experiments/multi30k_converged/background.sh carry [WORK]   # stop, and carry the runs in flight with the
#                                                                     # checkout's driver (its carry format)
#
# PAIR (fr or de, default fr), STAGES (default tune), SEEDS (default "1 2 3"), THREADS (default 2: one run with two
# threads trains twice as fast as one, and two runs side by side slow each other). WORK (default /work/study): the
# snapshot (WORK/code), the workdir (WORK/en_PAIR), the driver's log (WORK/en_PAIR.log) and its process group
# (WORK/en_PAIR.pid). `start` restores what a carry left beside the ledger; every run continues from its last
# checkpoint. BACKGROUND_DRY_RUN=1 prints the driver's command and starts nothing.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
verb=${1:?"background.sh: give start, pause, resume or carry"}
work=${2:-/work/study}
pair=${PAIR:-fr}
shared=${SOFTTOPK_SHARED:-$root/../shared}
pidfile=$work/en_$pair.pid
driver_args=(--data "$shared/data/multi30k_en_$pair" --blind "$shared/data/blind" --workdir "$work/en_$pair"
             --ledger "$root/experiments/multi30k_converged/en_$pair.jsonl")
running() { [[ -f $pidfile ]] && kill -0 -- "-$(cat "$pidfile")" 2> /dev/null; }
case $verb in
start)
    running && { echo "background.sh: already running (process group $(cat "$pidfile"))" >&2; exit 1; }
    # shellcheck disable=SC2206
    cmd=(nice -n 19 "$root/.venv/bin/python" "$work/code/experiments/multi30k_converged/driver.py" run
         "${driver_args[@]}" --stages ${STAGES:-tune} --retrain-missing --seeds ${SEEDS:-1 2 3})
    if [[ -n ${BACKGROUND_DRY_RUN:-} ]]; then
        printf '%q ' "${cmd[@]}"; echo
        exit 0
    fi
    # Under the kernel's autogroup scheduling (sched_autogroup_enabled), nice ranks processes only within their
    # autogroup, and setsid starts a new one: it would get an equal share of the CPU against the foreground's. It is
    # niced from inside (it exists only after setsid has run).
    niced_group='if [[ -w /proc/self/autogroup ]]; then echo 19 > /proc/self/autogroup || true; fi; exec "$@"'
    bash "$root/scripts/setup_env.sh"
    rm -rf "$work/code" && mkdir -p "$work/code"
    git -C "$root" archive HEAD | tar -x -C "$work/code"
    git -C "$root" rev-parse HEAD > "$work/code/COMMIT"  # (the driver's COMMIT_FILE: each start's log records it)
    # (PYTHONPATH: fairseq-train would import the checkout's package, installed in the venv in place of the snapshot's)
    OMP_NUM_THREADS=${THREADS:-2} PATH="$root/.venv/bin:$PATH" PYTHONPATH="$work/code" \
        setsid bash -c "$niced_group" background "${cmd[@]}" >> "$work/en_$pair.log" 2>&1 &
    echo $! > "$pidfile"
    echo "background.sh: started (process group $!), log $work/en_$pair.log"
    ;;
pause | resume)
    running || { echo "background.sh: not running" >&2; exit 1; }
    kill "-$([[ $verb == pause ]] && echo STOP || echo CONT)" -- "-$(cat "$pidfile")"
    ;;
carry)
    if running; then
        kill -CONT -- "-$(cat "$pidfile")"
        kill -- "-$(cat "$pidfile")"
        while running; do sleep 1; done
    fi
    OMP_NUM_THREADS=${THREADS:-2} "$root/.venv/bin/python" "$root/experiments/multi30k_converged/driver.py" carry \
        "${driver_args[@]}"
    ;;
*)
    echo "background.sh: give start, pause, resume or carry, not '$verb'" >&2
    exit 2
    ;;
esac
