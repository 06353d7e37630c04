#!/usr/bin/env bash
# make stress-tests: the Python suite's timing- and process-sensitive parts, repeated, on this
# machine as it is:
#   - the whole Python suite STRESS_SUITE_RUNS times in a row (default 3);
#   - once more with a busy loop in a second process keeping a core busy (started and stopped
#     here);
#   - examples/context_parallel.py under torchrun (2 ranks) STRESS_EXAMPLE_RUNS times for each
#     method (default 100), counting failures and aborts (SIGABRT, "terminate called").
# Logs go to out/stress (a failed example run keeps its own log); the summary, one line per
# part with runs, failures and wall time, is printed and kept in out/stress/summary.txt.
# Exits non-zero when anything failed. About 45 minutes on 2 cores.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$PWD/.venv/bin/python
SUITE_RUNS=${STRESS_SUITE_RUNS:-3}
EXAMPLE_RUNS=${STRESS_EXAMPLE_RUNS:-100}
OUT=out/stress
rm -rf "$OUT"
mkdir -p "$OUT"
summary=()
failed=0

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }'; }

# One full run of the Python suite (the README's test command runs it the same way).
suite() {
  local label=$1 start rc last
  start=$(now)
  make --no-print-directory test-python > "$OUT/$label.log" 2>&1
  rc=$?
  last=$(grep -E "[0-9]+ (passed|failed)" "$OUT/$label.log" | tail -1)
  summary+=("$label: exit code $rc; $last; $(since "$start") s")
  [ "$rc" -eq 0 ] || failed=1
}

for i in $(seq "$SUITE_RUNS"); do
  suite "suite-run-$i"
done

"$PY" -c "while True: pass" &
busy=$!
trap 'kill $busy 2>/dev/null' EXIT
suite "suite-with-a-busy-core"
kill "$busy"
wait "$busy" 2>/dev/null
trap - EXIT

for method in softmax favor; do
  start=$(now)
  failures=0
  aborts=0
  for i in $(seq "$EXAMPLE_RUNS"); do
    log="$OUT/example-$method.log"
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 examples/context_parallel.py \
      --method "$method" --tokens 96 > "$log" 2>&1
    rc=$?
    if [ "$rc" -ne 0 ] || ! grep -q "the 2-rank parameters equal the one-process ones" "$log"; then
      failures=$((failures + 1))
      grep -qE "SIGABRT|terminate called" "$log" && aborts=$((aborts + 1))
      cp "$log" "$OUT/example-$method-failed-run-$i.log"
    fi
  done
  summary+=("torchrun example --method $method: $EXAMPLE_RUNS runs, $failures failed, $aborts aborted; $(since "$start") s")
  [ "$failures" -eq 0 ] || failed=1
done

{
  echo "stress-tests on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
  printf '%s\n' "${summary[@]}"
  [ "$failed" -eq 0 ] && echo "all green" || echo "FAILED"
} | tee "$OUT/summary.txt"
exit "$failed"
