# GPU round 1 (2026-12-02): build gpu-verify (fp8-quantize + fp8-gemm + tile-256x128) on the GPU
# machine, FP8 tests + sanitizer, FP8 bench, tiles at the mixtral shapes.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
L=OUT/r1.log; exec > >(tee -a $L) 2>&1
D=$PWD/build/devdeps
mkdir -p runs/stub && echo 'void nodrop_dnnl_stub(void){}' | gcc -shared -x c - -o runs/stub/libdnnl.so
if [ ! -f build/dev/build.ninja ]; then
cmake -S . -B build/dev -G Ninja -DNODROP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release \
  -DNODROP_CUTLASS_DIR=$D/cutlass -DDNNL_INCLUDE_DIR=$D/dnnl/include -DDNNL_LIBRARY=runs/stub/libdnnl.so \
  -DGTEST_ROOT=$D/gtest -DGTest_ROOT=$D/gtest -DPython_EXECUTABLE=$(command -v python3) > OUT/cmake.log 2>&1 || { el cmake failed; tail -30 OUT/cmake.log; exit 1; }
fi
el configured
timeout 420 ninja -C build/dev -k 0 -j16 nodrop_ffi_cuda nodrop_cuda_tests nodrop_cuda_moe_tests nodrop_cuda_bench nodrop_cuda_fp8_bench > OUT/build.log 2>&1
rc=$?; el "build rc=$rc"; [ $rc -ne 0 ] && { grep -B2 -A12 -m3 "error" OUT/build.log | head -60; tail -5 OUT/build.log; exit 1; }
B=build/dev
strip -s -o OUT/libnodrop_ffi_cuda.so $B/libnodrop_ffi_cuda.so; ls -la OUT/libnodrop_ffi_cuda.so
$B/nodrop_cuda_tests --gtest_brief=1 --gtest_filter='CudaFp8*' 2>&1 | tail -25; el "fp8 gemm tests rc=${PIPESTATUS[0]}"
$B/nodrop_cuda_moe_tests --gtest_brief=1 --gtest_filter='*QuantizeFp8Gpu*' 2>&1 | tail -15; el "quantize tests rc=${PIPESTATUS[0]}"
for tool in memcheck racecheck; do
  timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 $B/nodrop_cuda_tests --gtest_brief=1 \
    --gtest_filter='CudaFp8BlockwiseGraph.*:CudaFp8BlockwiseArguments.*' 2>&1 | tail -4; el "$tool fp8 gemm rc=${PIPESTATUS[0]}"
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 $B/nodrop_cuda_moe_tests --gtest_brief=1 \
    --gtest_filter='*QuantizeFp8Gpu*bf16*' 2>&1 | tail -4; el "$tool quantize rc=${PIPESTATUS[0]}"
done
timeout 90 $B/nodrop_cuda_fp8_bench 2>&1 | tee OUT/fp8-bench.md; el "fp8 bench"
timeout 120 $B/nodrop_cuda_bench --tiles=all --iters=30 --shapes='mixtral preset gate+up,mixtral preset down,Mixtral-8x7B' --sizes=router-like 2>&1 | tee OUT/tiles-bench.md; el "tiles bench"
export PYTHONPATH=$PWD NODROP_CACHE=runs/cache
cp $B/libnodrop_ffi_cuda.so nodrop/
left=$(( 570 - ($(date +%s) - start) ))
[ $left -gt 30 ] && timeout $left python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu.py -k "fp8" 2>&1 | tail -8; el "pytest fp8"
