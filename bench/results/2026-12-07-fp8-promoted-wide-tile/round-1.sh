# GPU round 1 (2026-12-07): two promoted tensorwise tiles of 128x192 (cooperative, clusters 1x2
# and 2x1), each consumer warpgroup holding 64x192 in both accumulators, against the 128x128
# promoted tile on both gradients; built beforehand on the CPU machine
# (build/gpulib/bin.tar.xz: sm_90a binaries; deps.tar.xz: the libraries they link).
# In order of need, each step bounded by what is left of BUDGET seconds: every FP8 engine test;
# every tensorwise kernel on both gradients at every benchmark shape
# (nodrop_cuda_fp8_bench --mode=training --configs=all); compute-sanitizer on the new tiles'
# small cases; bench/gpu_fp8.py (the forward beside torch._scaled_grouped_mm).
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
timeout $(left 300) build/gpu/nodrop_cuda_fp8_bench --mode=training --configs=all \
  > $OUT/r/fp8-training-bench-all.md 2>&1
el "nodrop_cuda_fp8_bench --mode=training --configs=all rc=$?"
grep -E "128x(128|192)x128, cluster (1x2|2x1), promoted" $OUT/r/fp8-training-bench-all.md | head -60
pack
for tool in memcheck racecheck; do
  timeout $(left 200) compute-sanitizer --tool $tool --error-exitcode 9 \
    build/gpu/nodrop_cuda_tests --gtest_brief=1 --gtest_filter='*/CudaFp8TensorwiseContractTest.*/mixed_*128x192*:*/CudaFp8TensorwiseTest.*/mixed_*128x192*:*/CudaFp8TensorwiseTest.*/one_group_*128x192*' \
    > $OUT/r/sanitizer-$tool.log 2>&1
  el "compute-sanitizer $tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" $OUT/r/sanitizer-$tool.log | tail -3
done
pack
[ $(left) -gt 120 ] && { timeout $(left) python3 bench/gpu_fp8.py --out $OUT/r/gpu-fp8 \
  > $OUT/r/gpu-fp8.log 2>&1; el "gpu_fp8.py rc=$?"; sed -n '/## Targets/,$p' $OUT/r/gpu-fp8/gpu-fp8.md 2>/dev/null | head -30; }
el done
pack; rm -rf $OUT/r
