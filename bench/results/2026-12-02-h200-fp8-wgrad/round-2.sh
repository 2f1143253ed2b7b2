# GPU round 2 (2026-12-02, session 9): rebuild (vectorised quantisers); quantiser tests; find the
# illegal instruction of round 1's training bench (dsv3) with compute-sanitizer; training bench
# per shape; GPU pytest for FP8.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/r2
L=$OUT/r2/round.log; exec > >(tee -a $L) 2>&1
D=$PWD/build/devdeps
mkdir -p runs/stub && echo 'void nodrop_dnnl_stub(void){}' | gcc -shared -x c - -o runs/stub/libdnnl.so
if [ ! -f build/dev/build.ninja ]; then
cmake -S . -B build/dev -G Ninja -DNODROP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release \
  -DNODROP_CUTLASS_DIR=$D/cutlass -DDNNL_INCLUDE_DIR=$D/dnnl/include -DDNNL_LIBRARY=$PWD/runs/stub/libdnnl.so \
  -DGTEST_ROOT=$D/gtest -DGTest_ROOT=$D/gtest -DPython_EXECUTABLE=$(command -v python3) > $OUT/r2/cmake.log 2>&1 || { el cmake failed; tail -30 $OUT/r2/cmake.log; exit 1; }
fi
el configured
timeout 330 ninja -C build/dev -k 0 -j16 nodrop_ffi_cuda nodrop_cuda_tests nodrop_cuda_moe_tests nodrop_cuda_fp8_bench > $OUT/r2/build.log 2>&1
rc=$?; el "build rc=$rc"; [ $rc -ne 0 ] && { grep -B2 -A12 -m3 "error" $OUT/r2/build.log | head -60; tail -5 $OUT/r2/build.log; exit 1; }
B=build/dev
strip -s -o $OUT/libnodrop_ffi_cuda.so $B/libnodrop_ffi_cuda.so
$B/nodrop_cuda_moe_tests --gtest_brief=1 --gtest_filter='*QuantizeFp8*' 2>&1 | tail -8; el "quantize tests rc=${PIPESTATUS[0]}"
for tool in memcheck racecheck; do
  timeout 40 compute-sanitizer --tool $tool --error-exitcode 9 $B/nodrop_cuda_moe_tests --gtest_brief=1 \
    --gtest_filter='*QuantizeFp8*bf16*' 2>&1 | tail -3; el "$tool quantizers rc=${PIPESTATUS[0]}"
done
timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 3 $B/nodrop_cuda_fp8_bench --mode=training --shapes=dsv3 --iters=1 --warmup=0 2>&1 | tail -40 > $OUT/r2/dsv3-sanitizer.log; el "memcheck dsv3 training bench rc=${PIPESTATUS[0]}"; head -c 3000 $OUT/r2/dsv3-sanitizer.log
for s in mixtral qwen3 mixtral-gate-up mixtral-down dsv3-down dsv3; do
  timeout 60 $B/nodrop_cuda_fp8_bench --mode=training --configs=all --iters=20 --shapes=$s > $OUT/r2/training-$s.md 2>&1; el "training bench $s rc=$?"
done
cat $OUT/r2/training-*.md
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache
cp $B/libnodrop_ffi_cuda.so nodrop/
left=$(( 585 - ($(date +%s) - start) ))
[ $left -gt 30 ] && timeout $left python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu.py -k "fp8" 2>&1 | tail -8; el "pytest fp8"
