#!/usr/bin/env bash
# Everything to run on the accelerator machine after a change to GPU code, in one
# command, each step with a time limit, the outputs written to DIR (default ./gpu-report):
#   bash benchmarks/gpu_report.sh [DIR] [quick]
# "quick" skips the full-size benchmarks (a few minutes instead of about 15; split the full run
# over two device calls if one call's 10 minutes are not enough).
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-gpu-report}
MODE=${2:-full}
mkdir -p "$DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$DIR/steps.log"
    timeout "$limit" "$@" >"$DIR/$name.txt" 2>&1
    local rc=$?
    tail -n 25 "$DIR/$name.txt"
    echo "== $name: rc=$rc" | tee -a "$DIR/steps.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$DIR/device.txt" 2>&1
git rev-parse HEAD >>"$DIR/device.txt" 2>/dev/null
step build 240 make lib
step tests 300 python3 -m pytest -q -rs tests/test_cache.py tests/test_abi.py tests/test_bench.py tests/test_gguf.py tests/test_streams.py
step select_overhead 60 make --no-print-directory select-overhead
# compute-sanitizer over the GPU tests (CUDA backend only: -k cuda): memory errors, then races.
step memcheck 300 compute-sanitizer --tool memcheck --error-exitcode 1 --target-processes all \
    python3 -m pytest -q -x -k "cuda or another_stream" tests/test_cache.py tests/test_streams.py
step racecheck 300 compute-sanitizer --tool racecheck --error-exitcode 1 --target-processes all \
    python3 -m pytest -q -x -k "cuda and (checksum or select)" tests/test_cache.py
if [ "$MODE" != quick ]; then
    step transfer 200 python3 -m pyexpcache transfer
    step decode_pinned 300 python3 -m pyexpcache bench --quiet --json "$DIR/decode_pinned.json"
    step decode_no_layer_sync 240 python3 -m pyexpcache bench --quiet --no-layer-sync --variants expcache,resident \
        --json "$DIR/decode_no_layer_sync.json"
    step decode_pageable 200 python3 -m pyexpcache bench --quiet --source pageable --traces podA_c_python_full \
        --variants expcache,slab,nocache --json "$DIR/decode_pageable.json"
    step prefill_turns 330 python3 -m pyexpcache bench --quiet --scenario prefill,turns --variants expcache,slab \
        --json "$DIR/prefill_turns.json"
fi
