# GPU round 2 (2026-12-03): rebuild; find the illegal instruction that the training benchmark hits
# on its third shape (dsv3) after mixtral and qwen3 in one process (seen in round 1 and on
# 2026-12-02): with CUDA_LAUNCH_BLOCKING the failing call names itself; initcheck looks for reads
# of memory no kernel wrote. Then the training benchmark one shape per process, and
# bench/gpu_fp8.py (nodrop's FP8 forward against torch._scaled_grouped_mm).
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/r2
exec > >(tee -a $OUT/r2/round.log) 2>&1
D=$PWD/build/devdeps
mkdir -p runs/stub && echo 'void nodrop_dnnl_stub(void){}' | gcc -shared -x c - -o runs/stub/libdnnl.so
cmake -S . -B build/dev -G Ninja -DNODROP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release \
  -DNODROP_CUTLASS_DIR=$D/cutlass -DDNNL_INCLUDE_DIR=$D/dnnl/include -DDNNL_LIBRARY=$PWD/runs/stub/libdnnl.so \
  -DGTEST_ROOT=$D/gtest -DGTest_ROOT=$D/gtest -DPython_EXECUTABLE=$(command -v python3) > $OUT/r2/cmake.log 2>&1 || { el cmake failed; tail -30 $OUT/r2/cmake.log; exit 1; }
timeout 330 ninja -C build/dev -k 0 -j16 nodrop_ffi_cuda nodrop_cuda_fp8_bench > $OUT/r2/build.log 2>&1
rc=$?; el "build rc=$rc"; [ $rc -ne 0 ] && { grep -B2 -A12 -m3 "error" $OUT/r2/build.log | head -60; exit 1; }
B=build/dev
CUDA_LAUNCH_BLOCKING=1 timeout 60 $B/nodrop_cuda_fp8_bench --mode=training --iters=3 --warmup=1 --shapes=mixtral,qwen3,dsv3 2>&1 | tail -4; el "blocking mixtral,qwen3,dsv3 rc=${PIPESTATUS[0]}"
timeout 150 compute-sanitizer --tool initcheck --print-limit 5 $B/nodrop_cuda_fp8_bench --mode=training --iters=1 --warmup=0 --shapes=dsv3 > $OUT/r2/initcheck-dsv3.log 2>&1; el "initcheck dsv3 rc=$?"; head -c 2500 $OUT/r2/initcheck-dsv3.log; tail -3 $OUT/r2/initcheck-dsv3.log
for s in mixtral qwen3 dsv3 dsv3-down mixtral-gate-up mixtral-down; do
  timeout 40 $B/nodrop_cuda_fp8_bench --mode=training --iters=30 --shapes=$s > $OUT/r2/training-$s.md 2>&1; el "training bench $s rc=$?"
done
grep -h "^| [a-z]" $OUT/r2/training-*.md | sort -u
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1
cp $B/libnodrop_ffi_cuda.so nodrop/
left=$(( 580 - ($(date +%s) - start) ))
timeout $left python3 bench/gpu_fp8.py --out $OUT/r2 2>&1 | tail -60; el "gpu_fp8 rc=${PIPESTATUS[0]}"
