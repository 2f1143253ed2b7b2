# GPU round 1 (2026-12-07): the tensorwise recipe's gradients on per-tensor kernels (promoted
# accumulation; the weight gradient's tensorwise ragged contraction), built beforehand on the CPU
# machine (build/gpulib/bin.tar.xz: sm_90a binaries; deps.tar.xz: the libraries they link).
# In order of need, each step bounded by what is left of BUDGET seconds: every FP8 engine test;
# the layer's three GEMMs of both recipes against bf16 with every tensorwise gradient kernel
# (nodrop_cuda_fp8_bench --mode=training --configs=all); 120 steps of `mixtral` in bf16 and in
# the tensorwise recipe with both weight gradients (same weights and batches); compute-sanitizer
# on the new kernels' small cases; the JAX FP8 GPU tests; bench/gpu_fp8.py.
set -u
BUDGET=${BUDGET:-560}
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - start) - ${1:-10} )); }
mkdir -p $OUT/r
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
tar xJf build/gpulib/deps.tar.xz -C / --skip-old-files
mkdir -p build/gpu && tar xJf build/gpulib/bin.tar.xz -C build/gpu
cp build/gpu/libnodrop_ffi_cuda.so build/gpu/libnodrop_ffi_cpu.so nodrop/
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
build/gpu/nodrop_cuda_tests --gtest_brief=1 --gtest_filter='*Fp8*' > $OUT/r/fp8-tests.log 2>&1
el "nodrop_cuda_tests *Fp8* rc=$?"; tail -4 $OUT/r/fp8-tests.log
pack
timeout $(left 400) build/gpu/nodrop_cuda_fp8_bench --mode=training --configs=all \
  > $OUT/r/fp8-training-bench.md 2>&1
el "nodrop_cuda_fp8_bench --mode=training --configs=all rc=$?"
sed -n '/tensorwise recipe/,/^$/p' $OUT/r/fp8-training-bench.md | head -14
pack
timeout $(left 150) python3 -m nodrop compare --preset mixtral --steps 120 --capacity-factors \
  --fp8-recipes tensorwise --fp8-weight-gradients unquantised fp8 --eval-every 40 \
  --eval-batches 2 --checkpoint-every 0 --out $OUT/r/compare > $OUT/r/compare.log 2>&1
el "nodrop compare rc=$?"; sed -n '/^| run/,/^$/p' $OUT/r/compare/compare.md 2>/dev/null
pack
for tool in memcheck racecheck; do
  timeout $(left 90) compute-sanitizer --tool $tool --error-exitcode 9 \
    build/gpu/nodrop_cuda_tests --gtest_brief=1 --gtest_filter='CudaFp8TensorwiseContractGraph.*:*/CudaFp8TensorwiseContractTest.*/mixed_*:*/CudaFp8TensorwiseTest.*/mixed_*promoted*' \
    > $OUT/r/sanitizer-$tool.log 2>&1
  el "compute-sanitizer $tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" $OUT/r/sanitizer-$tool.log | tail -3
done
pack
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  timeout $(left) python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu.py -k fp8 \
  > $OUT/r/pytest-gpu.log 2>&1
el "pytest test_gpu.py -k fp8 rc=$?"; tail -3 $OUT/r/pytest-gpu.log
pack
[ $(left) -gt 150 ] && { timeout $(left) python3 bench/gpu_fp8.py --out $OUT/r/gpu-fp8 \
  > $OUT/r/gpu-fp8.log 2>&1; el "gpu_fp8.py rc=$?"; sed -n '/## Targets/,$p' $OUT/r/gpu-fp8/gpu-fp8.md 2>/dev/null | head -30; }
el done
pack; rm -rf $OUT/r
