#!/bin/sh
# Hunting: the regression's fail-over cycle back to back, each run on a fresh
# embedded cluster of its own, every run proven by Spark. Not a CI job (each
# run takes 1-3 minutes): a command for finding what a single run misses.
#
#   bench/hunt_failover.sh [RUNS] [OUT_DIR]
#
# RUNS (default 3) of each of the four kinds: --chaos-failover and
# --chaos --chaos-failover, each with a --sync and an --async standby.
# Prints one line per run (kind, exit code, kill -> promoted, kill -> first
# dequeue, the violations line) and a summary; each run's whole output is
# kept in OUT_DIR (default a new temporary folder). Exit 0 iff every run passed.
set -u
cd "$(dirname "$0")/.."
runs=${1:-3}
out=${2:-$(mktemp -d /tmp/ringq-hunt.XXXXXX)}
mkdir -p "$out"
RINGQ=$(pwd)/.venv/bin/ringq
export SPARK_LOCAL_IP=127.0.0.1
passed=0
failed=0
for i in $(seq 1 "$runs"); do
    for kind in "failover-sync" "failover-async" "chaos-failover-sync" "chaos-failover-async"; do
        case $kind in
            failover-sync) flags="--chaos-failover --sync" ;;
            failover-async) flags="--chaos-failover --async" ;;
            chaos-failover-sync) flags="--chaos --chaos-failover --sync" ;;
            chaos-failover-async) flags="--chaos --chaos-failover --async" ;;
        esac
        home="$out/home-$kind-$i"
        log="$out/$kind-$i.log"
        export RINGQ_HOME="$home"
        "$RINGQ" db start >"$log" 2>&1
        start=$(date +%s)
        # shellcheck disable=SC2086
        "$RINGQ" regress --cycles 1 --entries-per-queue 3000 --capacity 500 $flags >>"$log" 2>&1
        rc=$?
        took=$(( $(date +%s) - start ))
        "$RINGQ" db stop >/dev/null 2>&1
        timing=$(grep -o 'kill -> promoted [0-9.]* s   kill -> first dequeue [0-9.]* s' "$log" | head -1)
        verdict=$(grep -o 'violations .*' "$log" | head -1 | tr -s ' ')
        if [ "$rc" -eq 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
        echo "$kind #$i rc=$rc ${took}s | $timing | $verdict"
        [ "$rc" -eq 0 ] && rm -rf "$home"  # a failed run's cluster is kept to look at
    done
done
echo "hunt: $passed passed, $failed failed; logs in $out"
[ "$failed" -eq 0 ]
