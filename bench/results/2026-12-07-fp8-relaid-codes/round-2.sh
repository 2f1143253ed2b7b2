# GPU round 2 (2026-12-07, session 8): the bf16 grouped GEMM's host time. Round 1's benchmark
# timed every small bf16 GEMM at 0.75-0.88 ms (0.20-0.44 ms a day before): since a544f0c each
# call asks CUDA for the memory clock (the tile rule's bandwidth), which the driver does not
# cache. "before": round 1's libraries (build/gpulib/relay.tar.xz); "after": the same sources with
# memory_bandwidth asked once per device (build/gpulib/fix.tar.xz), both built on the
# development machine with nvcc 13.0 for sm_90a.
#   1. the new GPU test (CudaMemoryBandwidth) and the grouped matmul's argument and graph tests;
#   2. nodrop_cuda_fp8_bench --mode=training on four shapes, before and after (the bf16 columns);
#   3. bench/gpu_moe.py --only gemm on DeepSeek-V3's EP8 rank and Qwen3-30B-A3B beside
#      torch._grouped_mm, before and after;
#   4. if time is left, bench/gpu_moe.py --only layer on Mixtral with the FP8 weight gradient.
set -u
BUDGET=${BUDGET:-400}
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - start) - ${1:-10} )); }
mkdir -p $OUT/r
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
tar xJf build/gpulib/deps.tar.xz -C / --skip-old-files
mkdir -p build/before build/after
tar xJf build/gpulib/relay.tar.xz -C build/before && tar xJf build/gpulib/fix.tar.xz -C build/after
cp build/before/libnodrop_ffi_cpu.so build/after/
rm -rf /tmp/before && mkdir -p /tmp/before && cp -r nodrop /tmp/before/
cp build/before/libnodrop_ffi_cuda.so build/before/libnodrop_ffi_cpu.so /tmp/before/nodrop/
cp build/after/libnodrop_ffi_cuda.so build/after/libnodrop_ffi_cpu.so nodrop/
export PYTHONUNBUFFERED=1
REPO=$PWD

build/after/nodrop_cuda_tests --gtest_brief=1 \
  --gtest_filter='CudaMemoryBandwidth.*:CudaGroupedMatmulArguments.*:CudaGroupedMatmulGraph.*' \
  > $OUT/r/cuda-tests.log 2>&1
el "nodrop_cuda_tests rc=$?"; tail -3 $OUT/r/cuda-tests.log
for side in before after; do
  timeout 90 build/$side/nodrop_cuda_fp8_bench --mode=training \
    --shapes=qwen3-2k,dsv3,mixtral-2k,qwen3 > $OUT/r/fp8-bench-$side.md 2>&1
  el "fp8 bench $side rc=$?"; sed -n 3,8p $OUT/r/fp8-bench-$side.md | cut -d'|' -f2,7-10
done
pack
for side in before after; do
  from=$REPO; [ $side = before ] && from=/tmp/before
  [ $(left 60) -lt 0 ] && { el "no time for gpu_moe gemm $side"; continue; }
  PYTHONPATH=$from timeout $(left 15) python3 bench/gpu_moe.py --only gemm \
    --shapes DeepSeek-V3-EP8,Qwen3-30B-A3B --out $OUT/r/gemm-$side > $OUT/r/gemm-$side.log 2>&1
  el "gpu_moe gemm $side rc=$?"; grep -B2 -A12 "^| shape" $OUT/r/gemm-$side/gpu-moe.md | head -16
  pack
done
if [ $(left 90) -gt 0 ]; then
  PYTHONPATH=$REPO timeout $(left 10) python3 bench/gpu_moe.py --only layer \
    --shapes Mixtral-8x7B --fp8-weight-gradient fp8 --out $OUT/r/layer-fp8-wgrad \
    > $OUT/r/layer-fp8-wgrad.log 2>&1
  el "gpu_moe layer (FP8 weight gradient) rc=$?"; tail -30 $OUT/r/layer-fp8-wgrad.log
fi
el done
pack; rm -rf $OUT/r
