#!/usr/bin/env bash
# The CI suite (`make test`): every test but the `slow` ones, in three tiers, each listing
# its slowest tests; the suite fails if any tier does (all of them always run).
#
#   1. the unit tier (tests/unit and every *_unit.py: no Ray, no server; some of them
#      time themselves) on TEST_WORKERS pytest workers (pytest-xdist, by file), alone;
#   2. the Ray layers (the rest of tests/cluster and tests/serve), one test at a time at
#      the normal priority: their starvation bounds assume the machine is theirs, and
#      they leave it a quarter idle (waiting for answers, restarts, timeouts);
#   3. beside them, the engine tier (the rest of tests/engine: in-process forwards of the
#      default model, which only compute) on TEST_WORKERS workers at a lower priority: it
#      runs on what the Ray layers leave idle and cedes the cores when they want them.
#      Its processes run at nice 19 in a session of their own whose autogroup is at
#      nice ENGINE_SESSION_NICE (tests/lowered.py; 10: about a tenth of a core the Ray
#      layers want, so that neither side starves). Its output follows theirs.
#
# One torch thread per process (two processes' threads on two cores only wait for each
# other). Usage: tests/suite.sh [python] (default .venv/bin/python).
set -u
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
WORKERS=${TEST_WORKERS:-2}
ENGINE_SESSION_NICE=${ENGINE_SESSION_NICE:-10}
export OMP_NUM_THREADS=1

units=(tests/unit tests/engine/*_unit.py tests/cluster/*_unit.py tests/serve/*_unit.py)
rc=0
echo "== tests 1/3: the unit tier (${WORKERS} workers)"
"$PY" -m pytest -m "not slow" -q -n "$WORKERS" --dist loadfile --durations=10 "${units[@]}" || rc=$?

engine_log=$(mktemp)
"$PY" tests/lowered.py "$ENGINE_SESSION_NICE" "$PY" -m pytest -m "not slow" -q \
    -n "$WORKERS" --dist loadfile --durations=15 --ignore-glob='*_unit.py' tests/engine \
    > "$engine_log" 2>&1 &
engine=$!
trap 'kill -- -"$engine" 2>/dev/null; exit 130' INT TERM

echo "== tests 2/3: the Ray layers (one test at a time); the engine tier runs beside them"
"$PY" -m pytest -m "not slow" -q --durations=30 --ignore-glob='*_unit.py' \
    tests/cluster tests/serve || rc=$?

wait "$engine" || rc=$?
echo "== tests 3/3: the engine tier (${WORKERS} workers at nice 19, beside 2/3)"
cat "$engine_log"
rm -f "$engine_log"
exit $rc
