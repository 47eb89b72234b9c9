#!/usr/bin/env bash
# A lent GPU's whole check in one call (docs/benchmarks.md, "gpu"): install the carried
# wheels, the CUDA tests by file, then bench.gpu. Everything goes under $OUT; the end of
# the output is a short summary. Run it from the repository root with .gpu-wheels carried
# (make gpu-wheels here first). TESTS_S / BENCH_S bound each part; BENCH_ARGS adds to
# the bench's arguments (e.g. --quick). tests/engine/test_model_match.py's CUDA test needs
# the default model's GGUF, which cannot travel (90 MB against 64 MiB): not run there.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .gpu-wheels/*.whl > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD RAYGUIDE_TOKENIZER_DIR=$PWD/.gpu-wheels/tokenizer
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
    > "$OUT/smi.txt" 2>&1
python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, \
triton.__version__, torch.cuda.get_device_name())" >> "$OUT/smi.txt" 2>&1
cat "$OUT/smi.txt"
if [ "${TESTS_S:-150}" != 0 ]; then
  timeout "${TESTS_S:-150}" python3 -m pytest -m cuda -q -p no:cacheprovider --timeout 120 \
      tests/engine/test_triton_kernels_unit.py tests/engine/test_guided_unit.py \
      tests/engine/test_device_engine.py tests/engine/test_cuda_graphs.py > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -25
fi
timeout "${BENCH_S:-330}" python3 -m bench.gpu --json --no-record ${BENCH_ARGS:-} \
    > "$OUT/bench.out" 2> "$OUT/bench.err"
echo "bench rc=$?"
grep -v "^# partial" "$OUT/bench.err" | grep -v -E "it/s\]|^\s*$" | tail -30
grep -v "^# partial" "$OUT/bench.out" | tail -30
grep "^# partial" "$OUT/bench.err" | tail -1
# where the host's time goes at batch 64 (guided and not, graphs and overlap on), if the
# call has time left (PROFILE_BEFORE_S: seconds since the start)
if [ "$SECONDS" -lt "${PROFILE_BEFORE_S:-380}" ]; then
  timeout 60 python3 -m bench.gpu_host_profile --graphs --batch 64 --new 30 --out "$OUT" \
      2>&1 | grep -v "it/s\]" | tail -2
fi
