# GPU round 1 (2026-12-02, session 9): build; FP8 weight-gradient kernels and transposed quantiser:
# tests, sanitizers, training bench (all wgrad tiles); the GPU pytest for FP8.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/r1
L=$OUT/r1/round.log; exec > >(tee -a $L) 2>&1
D=$PWD/build/devdeps
mkdir -p runs/stub && echo 'void nodrop_dnnl_stub(void){}' | gcc -shared -x c - -o runs/stub/libdnnl.so
if [ ! -f build/dev/build.ninja ]; then
cmake -S . -B build/dev -G Ninja -DNODROP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release \
  -DNODROP_CUTLASS_DIR=$D/cutlass -DDNNL_INCLUDE_DIR=$D/dnnl/include -DDNNL_LIBRARY=$PWD/runs/stub/libdnnl.so \
  -DGTEST_ROOT=$D/gtest -DGTest_ROOT=$D/gtest -DPython_EXECUTABLE=$(command -v python3) > $OUT/r1/cmake.log 2>&1 || { el cmake failed; tail -30 $OUT/r1/cmake.log; exit 1; }
fi
el configured
timeout 360 ninja -C build/dev -k 0 -j16 nodrop_ffi_cuda nodrop_cuda_tests nodrop_cuda_moe_tests nodrop_cuda_fp8_bench > $OUT/r1/build.log 2>&1
rc=$?; el "build rc=$rc"; [ $rc -ne 0 ] && { grep -B2 -A12 -m3 "error" $OUT/r1/build.log | head -60; tail -5 $OUT/r1/build.log; exit 1; }
B=build/dev
strip -s -o $OUT/libnodrop_ffi_cuda.so $B/libnodrop_ffi_cuda.so
$B/nodrop_cuda_tests --gtest_brief=1 --gtest_filter='*CudaFp8*' 2>&1 | tail -25; el "fp8 gemm tests rc=${PIPESTATUS[0]}"
$B/nodrop_cuda_moe_tests --gtest_brief=1 --gtest_filter='*QuantizeFp8*' 2>&1 | tail -15; el "quantize tests rc=${PIPESTATUS[0]}"
for tool in memcheck racecheck; do
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 $B/nodrop_cuda_tests --gtest_brief=1 \
    --gtest_filter='CudaFp8ContractGraph.*:CudaFp8ContractArguments.*:*/CudaFp8ContractTest.*/mixed_auto*:*/CudaFp8BlockwiseTest.*/mixed_cooperative_128x128x128_1x1*' 2>&1 | tail -4; el "$tool fp8 gemm rc=${PIPESTATUS[0]}"
  timeout 40 compute-sanitizer --tool $tool --error-exitcode 9 $B/nodrop_cuda_moe_tests --gtest_brief=1 \
    --gtest_filter='*QuantizeFp8TransposedGpu*bf16*' 2>&1 | tail -4; el "$tool quantize transposed rc=${PIPESTATUS[0]}"
done
timeout 150 $B/nodrop_cuda_fp8_bench --mode=training --configs=all --iters=30 --shapes=mixtral,qwen3,dsv3,dsv3-down,mixtral-gate-up,mixtral-down 2>&1 | tee $OUT/r1/fp8-training-bench.md; el "fp8 training bench"
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache
cp $B/libnodrop_ffi_cuda.so nodrop/
left=$(( 580 - ($(date +%s) - start) ))
[ $left -gt 30 ] && timeout $left python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu.py -k "fp8" 2>&1 | tail -15; el "pytest fp8"
