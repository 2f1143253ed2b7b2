# GPU round 1 (2026-12-07): the forward's FP8 weights written by one engine pass
# (quantize_weights_transposed) instead of XLA's transpose-and-convert fusion. The engine tests of
# the new kernel and of the refactored transposed quantiser, compute-sanitizer on both; the
# weights quantiser's bandwidth against a copy (nodrop_cuda_fp8_bench --mode=training); the MoE
# layer (gpu_moe.py --only layer) with this tree's nodrop.ops.fp8 and, in the same process
# order on the same card, with the one before it (build/gpulib/fp8_before.py, HEAD 3fc33e9's);
# the FP8 layer's kernels (gpu_profile.py layer --fp8); the JAX FP8 GPU tests.
set -u
BUDGET=${BUDGET:-570}
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - start) - ${1:-10} )); }
mkdir -p $OUT/r
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz --exclude='trace-*' -C $OUT r; }
nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
tar xJf build/gpulib/deps.tar.xz -C / --skip-old-files
mkdir -p build/gpu && tar xJf build/gpulib/bin.tar.xz -C build/gpu
cp build/gpu/libnodrop_ffi_cuda.so build/gpu/libnodrop_ffi_cpu.so nodrop/
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# The package as it was before this change: the same libraries, HEAD's nodrop/ops/fp8.py.
mkdir -p /tmp/before && cp -r nodrop /tmp/before/ && cp build/gpulib/fp8_before.py /tmp/before/nodrop/ops/fp8.py
build/gpu/nodrop_cuda_moe_tests --gtest_brief=1 --gtest_filter='*Fp8*' > $OUT/r/moe-tests.log 2>&1
el "nodrop_cuda_moe_tests *Fp8* rc=$?"; tail -3 $OUT/r/moe-tests.log
for tool in memcheck racecheck; do
  timeout $(left 480) compute-sanitizer --tool $tool --error-exitcode 9 \
    build/gpu/nodrop_cuda_moe_tests --gtest_brief=1 \
    --gtest_filter='*QuantizeFp8WeightsTransposedGpu*:*QuantizeFp8TransposedGpu*' \
    > $OUT/r/sanitizer-$tool.log 2>&1
  el "compute-sanitizer $tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" $OUT/r/sanitizer-$tool.log | tail -3
done
pack
timeout $(left 420) build/gpu/nodrop_cuda_fp8_bench --mode=training \
  --shapes=mixtral-gate-up,mixtral-down,qwen3-gate-up,qwen3-down,dsv3,dsv3-down \
  > $OUT/r/fp8-training-bench.md 2>&1
el "nodrop_cuda_fp8_bench --mode=training rc=$?"
grep -A12 "Quantiser of the weights" $OUT/r/fp8-training-bench.md
pack
for which in after before; do
  [ $which = before ] && pp=/tmp/before || pp=$PWD
  PYTHONPATH=$pp timeout $(left 220) python3 bench/gpu_moe.py --only layer \
    --out $OUT/r/gpu-moe-layer-$which > $OUT/r/gpu-moe-layer-$which.log 2>&1
  el "gpu_moe.py --only layer ($which) rc=$?"
  sed -n '/## MoE expert layer, forward/,/## Targets/p' $OUT/r/gpu-moe-layer-$which/gpu-moe.md 2>/dev/null | head -24
  pack
done
timeout $(left 110) python3 bench/gpu_profile.py layer --shapes Mixtral-8x7B \
  --fp8 tensorwise blockwise --out $OUT/r/layer-profile > $OUT/r/layer-profile.log 2>&1
el "gpu_profile.py layer rc=$?"; grep -E "^### |quantiz|convert" $OUT/r/layer-profile/layer-profile.md | head -30
pack
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  timeout $(left) python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu.py -k fp8 \
  > $OUT/r/pytest-gpu.log 2>&1
el "pytest test_gpu.py -k fp8 rc=$?"; tail -3 $OUT/r/pytest-gpu.log
el done
pack; rm -rf $OUT/r
