#!/usr/bin/env bash
# Everything to run on the accelerator machine after a change to GPU code, each step with a time
# limit, the outputs written to DIR (default ./gpu-report):
#   bash benchmarks/gpu_report.sh [DIR] [STEP...]
# Steps, in order (default: all but the two experiments, copy_methods and staging_sweep; about
# 15 minutes together, so spread them over several device calls of at most 10 minutes, e.g.
# "build tests memcheck racecheck select_overhead", "build transfer decode_pinned",
# "build decode_no_layer_sync decode_pageable prefill_turns"; a device call brings back at most
# 8 files, and every step writes one or two):
#   build tests select_overhead memcheck racecheck copy_methods transfer staging_sweep
#   decode_pinned decode_no_layer_sync decode_pageable prefill_turns
#   device_lookup device_feed graph_loop graph_loop_pageable graph_loop_file decode_file_pool graph_loop_mmap
#   torch_graph (serving from the GPU: its tests and the feed's, the graph loop on the bundled
#   traces from pinned and from pageable memory and from a file read with O_DIRECT and mapped, the
#   torch step of a Qwen3-30B-A3B-like model at two budgets)
#   hf hf_decode (transformers models served by pyexpcache.hf: its tests, and the decode benchmark)
#   hf_quant hf_decode_fp8 hf_kernel_times hf_pretrained hf_pretrained_bench (FP8 experts: tests, benchmark
#   and the decode step's kernel times; hf_mxfp4 hf_decode_mxfp4: GPT-OSS's MXFP4 experts, tests and benchmark;
#   checkpoints read from their files: tests and benchmark)
#   flashlib verify_step (issue #37's side by side with flashlib 0.4.0's lru_ensure, the wheel
#   installed from .whl/ into /tmp/site when it is there, else it says it skipped; the 4-row
#   verification step against a fixed slot map); select_floor (the all-hit select per policy beside
#   empty kernels of its grid)
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-gpu-report}
shift || true
STEPS=${*:-build tests select_overhead memcheck racecheck transfer decode_pinned decode_no_layer_sync decode_pageable prefill_turns}
mkdir -p "$DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$DIR/steps.log"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$DIR/$name.txt" 2>&1
    local rc=$?
    tail -n 25 "$DIR/$name.txt"
    echo "== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$DIR/steps.log"
}
run_step() {
    case $1 in
    build) step build 240 make lib ;;
    tests) step tests 300 python3 -m pytest -q -rs --durations=5 tests/test_cache.py tests/test_abi.py \
        tests/test_policy.py tests/bench tests/test_gguf.py tests/test_streams.py ;;
    select_overhead) step select_overhead 60 make --no-print-directory select-overhead ;;
    # compute-sanitizer over the GPU tests (CUDA backend only): memory errors, then races.
    memcheck) step memcheck 300 compute-sanitizer --tool memcheck --error-exitcode 1 --target-processes all \
        python3 -m pytest -q -x -k "cuda or another_stream" tests/test_cache.py tests/test_streams.py \
        tests/test_gguf.py tests/test_device_lookup.py ;;
    racecheck) step racecheck 300 compute-sanitizer --tool racecheck --error-exitcode 1 --target-processes all \
        python3 -m pytest -q -x -k "cuda and (checksum or select)" tests/test_cache.py tests/test_device_lookup.py ;;
    copy_methods) step copy_methods 120 make --no-print-directory copy-methods ;;
    transfer) step transfer 300 python3 -m expcache_bench bench transfer --gib 0.5 --detail ;;
    staging_sweep) step staging_sweep 270 python3 benchmarks/staging_sweep.py --threads 8,12 --chunks 512K,1M ;;
    decode_pinned) step decode_pinned 300 python3 -m expcache_bench bench --quiet --json "$DIR/decode_pinned.json" ;;
    decode_no_layer_sync) step decode_no_layer_sync 240 python3 -m expcache_bench bench --quiet --no-layer-sync \
        --variants oppclass,lru,resident --json "$DIR/decode_no_layer_sync.json" ;;
    decode_pageable) step decode_pageable 200 python3 -m expcache_bench bench --quiet --source pageable \
        --traces podA_c_python_full --variants oppclass,slab,nocache --json "$DIR/decode_pageable.json" ;;
    prefill_turns) step prefill_turns 330 python3 -m expcache_bench bench --quiet --scenario prefill,turns \
        --variants oppclass,slab --json "$DIR/prefill_turns.json" ;;
    device_lookup) step device_lookup 300 python3 -m pytest -q -rs tests/test_device_lookup.py \
        tests/test_examples.py -k "cuda" ;;
    # The device select from sources the GPU cannot read (the feed): its tests, then the graph loop
    # from pageable memory beside the C loop from the same source.
    device_feed) step device_feed 240 python3 -m pytest -q -rs tests/test_device_feed.py -k "cuda" ;;
    graph_loop_pageable) step graph_loop_pageable 420 python3 -m expcache_bench bench graph --quiet --source pageable \
        --json "$DIR/graph_loop_pageable.json" ;;
    graph_loop) step graph_loop 420 python3 -m expcache_bench bench graph --quiet --json "$DIR/graph_loop.json" ;;
    # A model streamed from SSD: the generated experts of layers 33-42 (27 GiB, q2 and q4; the disk has
    # 64 GiB) in a file, read with O_DIRECT, then mapped; both loops from the file at the full model's
    # 12 GiB share, the disk's rate measured in the run. One step per device call (each about 3-6 minutes).
    graph_loop_file) step graph_loop_file 570 python3 -m expcache_bench bench graph --quiet --source file \
        --layers 33-42 --budget-fraction 0.15 --json "$DIR/graph_loop_file.json" ;;
    # The C loop from the same file with a host pool of 6 GiB (22 % of the file) between it and the GPU.
    decode_file_pool) step decode_file_pool 300 python3 -m expcache_bench bench --quiet --source file \
        --layers 33-42 --budget-fraction 0.15 --host-budget-gib 6 --variants duel,lru --json "$DIR/decode_file_pool.json" ;;
    graph_loop_mmap) step graph_loop_mmap 570 python3 -m expcache_bench bench graph --quiet --source mmap \
        --layers 33-42 --budget-fraction 0.15 --json "$DIR/graph_loop_mmap.json" ;;
    # 16 layers x 128 experts, top-8, hidden 2048, expert FFN 768, bf16: a budget that holds every expert
    # (the working set), then a quarter of them.
    torch_graph) step torch_graph 300 bash -c 'for f in 1.0 0.25; do python3 examples/torch_moe_decode.py \
        --device cuda --graph --layers 16 --experts 128 --top-k 8 --hidden 2048 --ffn 768 --tokens 64 \
        --budget-fraction $f || exit 1; done' ;;
    # pyexpcache.hf on CUDA: the tests, then the decode benchmark of a random Qwen3-MoE of real
    # layer geometry, offloaded at two budgets beside the unmodified model, eager and captured.
    hf) step hf 420 python3 -m pytest -q -rs tests/test_hf.py -k "cuda or not cpu" ;;
    hf_decode) step hf_decode 420 python3 benchmarks/hf_decode.py --device cuda --json "$DIR/hf_decode.json" ;;
    # FP8 experts (transformers' FP8Experts), computed by transformers' Triton kernel from the hub's
    # kernels-community/finegrained-fp8, whose torch-ext package travels in the git-ignored
    # .whl/kernels/ (the device has no hub): the tests on CUDA, then the same model's bf16 and FP8
    # experts side by side.
    hf_quant) step hf_quant 300 env EXPCACHE_FP8_KERNEL_DIR="$PWD/.whl/kernels" python3 -m pytest -q -rs \
        tests/test_hf_quantized.py -k "cuda or not cpu" ;;
    hf_decode_fp8) step hf_decode_fp8 540 python3 benchmarks/hf_decode.py --device cuda --quant bf16,fp8 --rounds 4 --tokens 32 \
        --fp8-kernel "$PWD/.whl/kernels" --json "$DIR/hf_decode_fp8.json" ;;
    # GPT-OSS's MXFP4 experts, triton_kernels from .whl/kernels/ (kernels-community/gpt-oss-triton-kernels'
    # torch-ext folder): the tests on CUDA, then GPT-OSS-20B's layer geometry (6 layers) in bf16 and MXFP4.
    hf_mxfp4) step hf_mxfp4 300 env EXPCACHE_MXFP4_KERNEL_DIR="$PWD/.whl/kernels" python3 -m pytest -q -rs \
        tests/test_hf_mxfp4.py ;;
    hf_decode_mxfp4) step hf_decode_mxfp4 420 python3 benchmarks/hf_decode.py --device cuda --model gpt_oss \
        --quant bf16,mxfp4 --rounds 3 --tokens 32 --mxfp4-kernel "$PWD/.whl/kernels" --json "$DIR/hf_decode_mxfp4.json" ;;
    # Where the served FP8 model's decode step spends its GPU time, beside the unmodified one's.
    hf_kernel_times) step hf_kernel_times 300 python3 benchmarks/hf_kernel_times.py --quant fp8 \
        --fp8-kernel "$PWD/.whl/kernels" --budget 1.0 --tokens 16 ;;
    # A checkpoint of Qwen3-30B-A3B's layer geometry (16 layers, 18 GiB of experts) written to the
    # device's disk and served from its files, a host pool of a quarter of the experts, 25 % on the GPU.
    hf_pretrained_bench) step hf_pretrained_bench 540 python3 benchmarks/hf_pretrained.py --dir "$DIR/ckpt" \
        --json "$DIR/hf_pretrained.json" ;;
    # Checkpoints read from their files (offload_pretrained): its tests on CUDA.
    hf_pretrained) step hf_pretrained 240 python3 -m pytest -q -rs tests/test_hf_pretrained.py \
        tests/test_file_source_parts.py -k "cuda or not cpu" ;;
    # The flashlib wheel (pip download --no-deps flashlib==0.4.0) travels in the git-ignored .whl/.
    flashlib) step flashlib 300 bash -c 'w=.whl/flashlib-0.4.0-py3-none-any.whl
        [ -f "$w" ] && pip install -q --no-deps --upgrade --target /tmp/site "$w"
        PYTHONPATH=/tmp/site:$PYTHONPATH python3 benchmarks/flashlib_side_by_side.py --json "$1/flashlib.json"' _ "$DIR" ;;
    verify_step) step verify_step 240 python3 benchmarks/verify_step.py --json "$DIR/verify_step.json" ;;
    select_floor) step select_floor 150 python3 benchmarks/select_floor.py ;;
    *) echo "unknown step: $1" >&2; return 2 ;;
    esac
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$DIR/device.txt" 2>&1
[ -n "${EXPCACHE_COMMIT:-}" ] && echo "commit $EXPCACHE_COMMIT" >>"$DIR/device.txt"  # the tree copied to the device may carry a stale .git
for s in $STEPS; do run_step "$s"; done
