# GPU round 5 (2026-12-07): the input gradient's weights quantised by the engine too
# (quantize_weights, in place) instead of XLA's fusions. The engine tests of both weights
# kernels and compute-sanitizer on them; the weights quantisers against a copy; the MoE layer
# with this tree's nodrop.ops.fp8 and with c94467b's (build/gpulib/fp8_before.py: the forward's
# weights on the engine, the input gradient's in XLA), the same card; the JAX weights tests.
set -u
BUDGET=${BUDGET:-320}
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - start) - ${1:-10} )); }
mkdir -p $OUT/r
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi -L
tar xJf build/gpulib/deps.tar.xz -C / --skip-old-files
mkdir -p build/gpu && tar xJf build/gpulib/bin.tar.xz -C build/gpu
cp build/gpu/libnodrop_ffi_cuda.so build/gpu/libnodrop_ffi_cpu.so nodrop/
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/before && cp -r nodrop /tmp/before/ && cp build/gpulib/fp8_before.py /tmp/before/nodrop/ops/fp8.py
build/gpu/nodrop_cuda_moe_tests --gtest_brief=1 --gtest_filter='*Fp8*' > $OUT/r/moe-tests.log 2>&1
el "nodrop_cuda_moe_tests *Fp8* rc=$?"; tail -2 $OUT/r/moe-tests.log
for tool in memcheck racecheck; do
  timeout $(left 250) compute-sanitizer --tool $tool --error-exitcode 9 \
    build/gpu/nodrop_cuda_moe_tests --gtest_brief=1 --gtest_filter='*QuantizeFp8Weights*' \
    > $OUT/r/sanitizer-$tool.log 2>&1
  el "compute-sanitizer $tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" $OUT/r/sanitizer-$tool.log | tail -3
done
timeout $(left 230) build/gpu/nodrop_cuda_fp8_bench --mode=training \
  --shapes=mixtral-gate-up,mixtral-down,qwen3-gate-up,qwen3-down > $OUT/r/fp8-training-bench.md 2>&1
el "nodrop_cuda_fp8_bench --mode=training rc=$?"; grep -A8 "Quantiser of the weights" $OUT/r/fp8-training-bench.md
pack
for which in after before; do
  [ $which = before ] && pp=/tmp/before || pp=$PWD
  PYTHONPATH=$pp timeout $(left 60) python3 bench/gpu_moe.py --only layer \
    --out $OUT/r/gpu-moe-layer-$which > $OUT/r/gpu-moe-layer-$which.log 2>&1
  el "gpu_moe.py --only layer ($which) rc=$?"
  sed -n '/^| shape/,/^$/p' $OUT/r/gpu-moe-layer-$which/gpu-moe.md 2>/dev/null | head -12
  pack
done
timeout $(left) python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu.py \
  -k "quantize_weights or recipe_runs" > $OUT/r/pytest-gpu.log 2>&1
el "pytest test_gpu.py -k 'quantize_weights or recipe_runs' rc=$?"; tail -2 $OUT/r/pytest-gpu.log
el done
pack; rm -rf $OUT/r
