# GPU round 1 (2026-12-03): build; the quantisers (rows with more loads in flight, transposed on
# 128-column tiles, and the output gradient's rows and transposed copy from one read): engine
# tests bitwise against the CPU, compute-sanitizer, the training benchmark (bandwidth against a
# copy, a layer's FP8 time with the recipe's quantisation), the FP8 GPU tests through JAX.
# Run from the repository root with OUT set; CUTLASS, GoogleTest and oneDNN headers carried in
# build/devdeps (see the results README).
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/r1
exec > >(tee -a $OUT/r1/round.log) 2>&1
D=$PWD/build/devdeps
mkdir -p runs/stub && echo 'void nodrop_dnnl_stub(void){}' | gcc -shared -x c - -o runs/stub/libdnnl.so
cmake -S . -B build/dev -G Ninja -DNODROP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release \
  -DNODROP_CUTLASS_DIR=$D/cutlass -DDNNL_INCLUDE_DIR=$D/dnnl/include -DDNNL_LIBRARY=$PWD/runs/stub/libdnnl.so \
  -DGTEST_ROOT=$D/gtest -DGTest_ROOT=$D/gtest -DPython_EXECUTABLE=$(command -v python3) > $OUT/r1/cmake.log 2>&1 || { el cmake failed; tail -30 $OUT/r1/cmake.log; exit 1; }
el configured
timeout 330 ninja -C build/dev -k 0 -j16 nodrop_ffi_cuda nodrop_cuda_moe_tests nodrop_cuda_fp8_bench > $OUT/r1/build.log 2>&1
rc=$?; el "build rc=$rc"; [ $rc -ne 0 ] && { grep -B2 -A12 -m3 "error" $OUT/r1/build.log | head -60; tail -5 $OUT/r1/build.log; exit 1; }
B=build/dev
strip -s -o $OUT/libnodrop_ffi_cuda.so $B/libnodrop_ffi_cuda.so
$B/nodrop_cuda_moe_tests --gtest_brief=1 --gtest_filter='*QuantizeFp8*' 2>&1 | tail -15; el "quantize tests rc=${PIPESTATUS[0]}"
for tool in memcheck racecheck; do
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 $B/nodrop_cuda_moe_tests --gtest_brief=1 \
    --gtest_filter='*QuantizeFp8*bf16*:*QuantizeFp8*Args*' 2>&1 | tail -4; el "$tool quantizers rc=${PIPESTATUS[0]}"
done
timeout 120 $B/nodrop_cuda_fp8_bench --mode=training --iters=30 --shapes=mixtral,qwen3,dsv3,dsv3-down,mixtral-gate-up,mixtral-down 2>&1 | tee $OUT/r1/fp8-training-bench.md; el "fp8 training bench rc=${PIPESTATUS[0]}"
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache
cp $B/libnodrop_ffi_cuda.so nodrop/
left=$(( 575 - ($(date +%s) - start) ))
[ $left -gt 30 ] && timeout $left python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu.py -k "fp8" 2>&1 | tail -15; el "pytest fp8 rc=${PIPESTATUS[0]}"
