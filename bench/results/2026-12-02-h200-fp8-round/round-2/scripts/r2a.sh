# GPU round 2, call A (2026-12-02): build the merged tree on the GPU machine; the engine's GPU
# tests (FP8 kernels of every configuration, the MoE kernels), compute-sanitizer on small cases
# of every new kernel, the FP8 benchmark of every configuration; the FFI library comes back.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
exec > >(tee -a OUT/r2a.log) 2>&1
D=$PWD/build/devdeps
mkdir -p runs/stub && echo 'void nodrop_dnnl_stub(void){}' | gcc -shared -x c - -o runs/stub/libdnnl.so
cmake -S . -B build/dev -G Ninja -DNODROP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release \
  -DNODROP_CUTLASS_DIR=$D/cutlass -DDNNL_INCLUDE_DIR=$D/dnnl/include -DDNNL_LIBRARY=runs/stub/libdnnl.so \
  -DGTEST_ROOT=$D/gtest -DGTest_ROOT=$D/gtest -DPython_EXECUTABLE=$(command -v python3) > OUT/cmake.log 2>&1 || { el cmake failed; tail -30 OUT/cmake.log; exit 1; }
el configured
timeout 400 ninja -C build/dev -k 0 -j16 nodrop_ffi_cuda nodrop_cuda_tests nodrop_cuda_moe_tests nodrop_cuda_fp8_bench nodrop_tile_rule_tests > OUT/build.log 2>&1
rc=$?; el "build rc=$rc"; [ $rc -ne 0 ] && { grep -B2 -A12 -m3 "error" OUT/build.log | head -60; tail -5 OUT/build.log; }
B=build/dev
strip -s -o OUT/libnodrop_ffi_cuda.so $B/libnodrop_ffi_cuda.so; ls -la OUT/libnodrop_ffi_cuda.so
$B/nodrop_tile_rule_tests --gtest_brief=1 2>&1 | tail -2; el "tile rule tests rc=${PIPESTATUS[0]}"
$B/nodrop_cuda_tests --gtest_brief=1 --gtest_filter="CudaFp8*:*/CudaFp8*${EXTRA_GEMM_FILTER:-}" 2>&1 | tail -8; el "fp8 gemm tests rc=${PIPESTATUS[0]}"
$B/nodrop_cuda_moe_tests --gtest_brief=1 2>&1 | tail -4; el "moe tests rc=${PIPESTATUS[0]}"
for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 $B/nodrop_cuda_tests --gtest_brief=1 \
    --gtest_filter="*/CudaFp8BlockwiseTest.*/mixed_*:CudaFp8BlockwiseGraph.*${EXTRA_SAN_FILTER:-}" 2>&1 | tail -3; el "$tool gemm rc=${PIPESTATUS[0]}"
done
timeout 150 $B/nodrop_cuda_fp8_bench --configs=all 2>&1 > OUT/fp8-bench.md; el "fp8 bench rc=$?"; tail -14 OUT/fp8-bench.md
left=$(( 560 - ($(date +%s) - start) ))
[ $left -gt 20 ] && { timeout $left $B/nodrop_cuda_tests --gtest_brief=1 2>&1 | tail -6; el "all gemm tests rc=${PIPESTATUS[0]}"; }
