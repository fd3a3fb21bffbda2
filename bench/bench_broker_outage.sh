#!/usr/bin/env bash
# Broker outage: how many lines the admission processor logs while its Kafka broker is down, and how
# soon it decides again once the broker is back (reconnect storms).
#
# Starts a private single-node broker (ports 19092/19093, data in a temp dir; the stack's own broker
# is not touched), creates a namespace's topics, starts `python -m projections` against it, waits
# WARMUP_S, stops the broker for DOWN_S, starts it again, times the first decision (a ReconcileDue
# probe through the inbox), waits 10 s more, and prints the processor's log lines from the stop on,
# by template, and the lines the repeated-line filter suppressed (infra/runtime/log_limits.py).
#
# Usage: bench/bench_broker_outage.sh [DOWN_S] [CHECKOUT]
#   CHECKOUT: the source tree whose processor runs (default: this one); another checkout, e.g. a
#   `git archive` of an older commit, gives the baseline in the same conditions. The probe, the
#   broker scripts and the venv are always this checkout's.
set -euo pipefail
DOWN_S=${1:-10}
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKOUT="$(cd "${2:-$HERE}" && pwd)"
PY="${CHATPLANE_PYTHON:-$HERE/.venv/bin/python}"
WARMUP_S=25
AFTER_S=10
WORK="$(mktemp -d /tmp/chatplane-outage.XXXXXX)"
export CHATPLANE_LIB_DIR="${CHATPLANE_LIB_DIR:-$HERE/infra/lib}" CHATPLANE_KAFKA_PORT=19092 CHATPLANE_KAFKA_CONTROLLER_PORT=19093
export CHATPLANE_VAR_DIR="$WORK/var" CHATPLANE_RUN_DIR="$WORK/run" CHATPLANE_PYTHON="$PY"
export CHATPLANE_KAFKA_BOOTSTRAP=127.0.0.1:19092 CHATPLANE_NAMESPACE=outage CHATPLANE_MODEL_CATALOG="$HERE/tests/fixtures/catalog.toml"
log="$WORK/processor.log"
pid=""
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  "$HERE/infra/kafka-stop" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

"$HERE/infra/kafka-start" >/dev/null
(cd "$HERE" && "$PY" -c '
import asyncio
from infra.runtime.kafka_admin import deployment_topics, ensure_topics
from schemas.topics import Topology
asyncio.run(ensure_topics("127.0.0.1:19092", deployment_topics(Topology("outage"))))')
(cd "$CHECKOUT" && CHATPLANE_PROCESSOR_ID=p1 CHATPLANE_DATA_DIR="$WORK/data" PYTHONUNBUFFERED=1 \
  exec "$PY" -m projections >"$log" 2>&1) &
pid=$!
sleep "$WARMUP_S"
before=$(wc -l <"$log")
"$HERE/infra/kafka-stop" >/dev/null
sleep "$DOWN_S"
during=$(( $(wc -l <"$log") - before ))
"$HERE/infra/kafka-start" >/dev/null
recover_s=$(cd "$HERE" && "$PY" -c '
import asyncio, time
from infra.runtime.command_client import CommandClient
from schemas.topics import Topology
from infra.harness.processes import wait_until_deciding
async def main():
    t0 = time.monotonic()
    client = CommandClient("127.0.0.1:19092", Topology("outage"), inbox_partition=0)
    await client.start()
    try:
        await wait_until_deciding(client, timeout_s=60)
    finally:
        await client.stop()
    print(f"{time.monotonic() - t0:.2f}")
asyncio.run(main())')
sleep "$AFTER_S"
lines=$(( $(wc -l <"$log") - before ))
suppressed=$(tail -n "+$((before + 1))" "$log" | grep -o 'suppressed [0-9]*' | awk '{s += $2} END {print s + 0}')
echo "processor of $CHECKOUT, broker down ${DOWN_S} s:"
echo "  lines logged while down: $during; from the stop to ${AFTER_S} s after the first decision: $lines (+ $suppressed suppressed by the filter)"
echo "  first decision ${recover_s} s after the restarted broker was ready"
echo "  lines by template (digits as N):"
tail -n "+$((before + 1))" "$log" | sed -E 's/^\[[^]]*\] \[[0-9]+\] //; s/[0-9]+/N/g' | cut -c1-100 | sort | uniq -c | sort -rn | head -12
