#!/usr/bin/env bash
# Everything kvcompile checks on a GPU, in one call. Run from the repo root:
#
#   bash benchmarks/gpu_check.sh            # tests, CUDA graphs + model tests, e2e decode benchmark, example
#                                           # (about 20 min on a fresh H100, past one call: split them with STEPS)
#   KERNEL_BENCH=1 bash benchmarks/gpu_check.sh   # also the per-kernel decode/prefill/store tables
#   SANITIZE=1 ...                                 # also compute-sanitizer memcheck of every kernel
#   STEPS=e2e,generate bash benchmarks/gpu_check.sh   # only these steps (tests, graphs, e2e, kernels,
#                                                     # standing, sanitize, generate) when a call must stay short
#   STEPS=standing bash benchmarks/gpu_check.sh       # the default format against fp8: decode, prefill, model step
#   STEPS=ttft bash benchmarks/gpu_check.sh           # long prompts: time to first token, attention over a prefix
#                                                     # (TTFT_PROVIDERS=...,kvc-fp8_e4m3@fp8: also under KVCOMPILE_PREFILL_Q=fp8)
#   STEPS=prefillq bash benchmarks/gpu_check.sh       # the prefill's opt-in quantized q / e4m3 P: GPU tests, timings, errors
#
# tests/test_formats.py needs the gguf package: `pip install gguf`, or a copy of it in .whl/gguf
# on a machine without a package index (see below).
#
# Logs and CSVs go to $OUT (default ./out); the last lines printed
# are the short tables. Each step has its own timeout so one hang does not eat the call.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# tests/test_formats.py's q8_0 oracle is the pure-Python gguf package: where it cannot be
# installed, copy it to .whl/gguf and it goes on PYTHONPATH
[ -d .whl/gguf ] && export PYTHONPATH=$PYTHONPATH:$PWD/.whl
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
STEPS=${STEPS:-tests,graphs,e2e,generate}
[ "${KERNEL_BENCH:-0}" = 1 ] && STEPS=$STEPS,kernels
[ "${SANITIZE:-0}" = 1 ] && STEPS=$STEPS,sanitize
want() { [[ ",$STEPS," == *",$1,"* ]]; }
nvidia-smi -L
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python -m kvcompile info > "$OUT/info.txt" 2>&1

# 1. kernel + op + cache tests compiled for the GPU (Triton compile time dominates: 8 workers; 16 run the
#    GPU out of memory). About 7 min on a fresh H100 (an empty Triton cache): run this step alone in a call
if want tests; then
    timeout 570 python -m pytest -q -n 8 tests/test_kernels.py tests/test_kernels_features.py tests/test_tiles.py \
        tests/test_formats.py tests/test_int8.py tests/test_rotation.py tests/test_kernels_rotation.py tests/test_ops.py \
        tests/test_sass.py tests/test_cache_formats.py > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests: $(tail -1 "$OUT/gpu_tests.log")"
fi

# 2. decode under CUDA graphs: replay == non-graph compiled code, no re-capture, no recompile; whole
#    models whose attention the pass reaches through less common spellings (GPT-J, Falcon, GPT-2)
if want graphs; then
    # each case compiles a model: serially about 10.5 min on a fresh H100 (past one call), so 4 workers
    # (03d07a9 on an H100: 20 passed within one call); run this step alone in a call
    timeout 570 python -m pytest -q -n 4 tests/test_cudagraphs.py tests/test_gpu_families.py > "$OUT/cudagraphs.log" 2>&1
    echo "cudagraph and model tests: $(tail -1 "$OUT/cudagraphs.log")"
fi

# 3. end-to-end decode step, the issue's two target points, default formats (fp8 = token scales)
if want e2e; then
    timeout 200 python benchmarks/bench_decode_e2e.py --layers 4 --cases 8x32768,1x1024 \
        --providers hf-static-compiled,kvc-fp8_e4m3-graphs,kvc-int8-graphs,kvc-q8_0-graphs,kvc-fp8_e4m3-eager \
        --out "$OUT/e2e_${commit}.csv" > "$OUT/e2e.log" 2>&1
    tail -9 "$OUT/e2e.log"
fi

# 4. optional: per-kernel tables (ratios to bf16 SDPA in the same run)
if want kernels; then
    # the rows in each format's cache layout; --sweep '^V ' adds the other V layout at the sweep shapes
    timeout 300 python benchmarks/bench_kv.py --decode-shapes 1x4096,1x32768,8x32768,4x131072 --prefill-q 16384,1024 \
        --formats fp8,q8_0,int8+rot --prefill-formats fp8,int8+rot \
        --sweep --variants '^V (keys|head_dim)$' --out "$OUT/bench_kv_${commit}.csv" > "$OUT/bench_kv.log" 2>&1
    grep -E "^\| " "$OUT/bench_kv.log" | grep -v "^|---"
fi

# 4a. optional: the standing comparison of the default format with fp8 (seven decode shapes, prefill at five
#     lengths with int8's K widened beside its int8 MMAs, the model step), as the standing run of benchmarks/tables.py
if want standing; then
    timeout 200 python benchmarks/bench_kv.py --subjects decode --formats fp8,int8+krot \
        --decode-shapes 1x4096,8x4096,4x8192,1x32768,8x32768,32x8192,4x131072 \
        --out "$OUT/decode_${commit}.csv" > "$OUT/standing_decode.log" 2>&1
    timeout 200 python benchmarks/bench_kv.py --subjects prefill --prefill-q 16384,4096,2048,1024,512 \
        --prefill-formats fp8,int8+krot --sweep --out "$OUT/prefill_${commit}.csv" > "$OUT/standing_prefill.log" 2>&1
    timeout 150 python benchmarks/bench_decode_e2e.py --layers 4 --cases 8x32768,1x1024,1x4096 --steps 10 \
        --providers hf-static-compiled,kvc-fp8_e4m3-graphs,kvc-int8-graphs \
        --out "$OUT/e2e_standing_${commit}.csv" > "$OUT/standing_e2e.log" 2>&1
    grep -hE "^\| (decode|prefill) " "$OUT/standing_decode.log" "$OUT/standing_prefill.log"
    grep "^{" "$OUT/standing_e2e.log" | cut -c1-110
fi

# 4c. optional: long prompts. Time to first token of a 32k prompt over 8 Llama-3-8B-shaped layers (one forward and
#     chunks of 2048, against DynamicCache eager and StaticCache compiled), and the attention over an 8-bit prefix
#     against the fastest bf16 SDPA path per shape (fused and dense, 16k and 32k cached positions)
if want ttft; then
    timeout 150 python benchmarks/bench_kv.py --subjects prefill --prefill-q 16384,4096,2048,1024,512 --prefill-L 16384 \
        --prefill-formats fp8,int8+krot --out "$OUT/prefill16k_${commit}.csv" > "$OUT/ttft_prefill16k.log" 2>&1
    timeout 100 python benchmarks/bench_kv.py --subjects prefill --prefill-q 2048 --prefill-L 32768 \
        --prefill-formats fp8,int8+krot --out "$OUT/prefill32k_${commit}.csv" > "$OUT/ttft_prefill32k.log" 2>&1
    timeout 330 python benchmarks/bench_ttft.py --layers 8 --prompts "${TTFT_PROMPTS:-32768}" --chunks 0,2048 \
        --providers "${TTFT_PROVIDERS:-hf-dynamic-eager,hf-static-compiled,kvc-int8,kvc-fp8_e4m3}" \
        --out "$OUT/ttft_${commit}.csv" > "$OUT/ttft.log" 2>&1
    grep -hE "^prefill " "$OUT/ttft_prefill16k.log" "$OUT/ttft_prefill32k.log" | grep -v eager
    grep -E "^\| |failed" "$OUT/ttft.log"
fi

# 4d. optional: the fused prefill's opt-in quantized q / e4m3 P (KVCOMPILE_PREFILL_Q) and the non-finite policy on
#     the GPU: their GPU tests, each prefill variant at the plan's tile (the fp8 dots as Triton sums them, the
#     scores' sums promoted every 32 products, P V's once per key tile: plan.LaunchPlan.fp8_acc), 16k cached
#     positions, against the fastest bf16 SDPA path; then each variant's error against float64 by cached length
if want prefillq; then
    timeout 240 python -m pytest -q -n 8 -m gpu tests/test_kernels_prefill_q.py tests/test_nonfinite.py \
        tests/test_kernels.py tests/test_kernels_features.py > "$OUT/prefillq_tests.log" 2>&1
    echo "prefill-q and non-finite GPU tests: $(tail -1 "$OUT/prefillq_tests.log")"
    timeout 200 python benchmarks/bench_kv.py --subjects prefill --prefill-q 16384,2048 --prefill-L 16384 \
        --prefill-formats int8+krot,fp8 --prefill-variants exact,q8,q8+p8,q8/acc32,q8+p8/acctile --prefill-tiles plan \
        --out "$OUT/prefillq_${commit}.csv" > "$OUT/prefillq.log" 2>&1
    timeout 150 python benchmarks/err_prefill_q.py --L 4096,16384,65536 --tq 1024 --acc 0,32,tile \
        --out "$OUT/err_prefillq_${commit}.csv" > "$OUT/err_prefillq.log" 2>&1
    grep -hE "^(prefill|sweep) " "$OUT/prefillq.log" | grep -v eager
    grep -E "^\| (fp8|int8)" "$OUT/err_prefillq.log"
fi

# 4b. optional: memcheck of every kernel on odd shapes (both V layouts), every format and rotation
#     (about 5 min on a fresh H100, mostly Triton compiling under the sanitizer)
if want sanitize; then
    timeout 450 compute-sanitizer --tool memcheck python benchmarks/bench_kv.py --subjects smoke \
        --formats fp8,fp8/block32,fp8/static,q8_0,int8,int8+rot,int8+krot > "$OUT/memcheck.log" 2>&1
    echo "memcheck: $(grep -E 'ERROR SUMMARY|smoke done' "$OUT/memcheck.log" | tr '\n' ' ')"
fi


# 5. the README's main job on CUDA (tiny random model: the GGUF wheel is not on the device)
if want generate; then
    timeout 90 python examples/generate.py --tiny --device cuda --max-new-tokens 24 > "$OUT/generate.log" 2>&1
    echo "generate: $(grep -E 'pass report' "$OUT/generate.log" || tail -1 "$OUT/generate.log")"
fi

echo "commit $commit"
