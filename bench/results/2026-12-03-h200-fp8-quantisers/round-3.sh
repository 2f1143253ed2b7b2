# GPU round 3 (2026-12-03, tree 3ca813c): the bf16 grouped GEMM's CUTLASS workspace zeroed before
# each call (grouped_matmul.cu) and the transposed quantiser without its kRows branch, on
# binaries built on the development machine and carried as build/gpulib (stripped
# nodrop_cuda_fp8_bench, nodrop_cuda_moe_tests, libnodrop_ffi_cuda.so). The six
# training-benchmark shapes in one process (the order that stopped with an illegal instruction
# in rounds 1 and 2), initcheck on dsv3 alone, the quantiser tests and sanitizers, and the FP8
# GPU tests through JAX.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/r3
exec > >(tee -a $OUT/r3/round.log) 2>&1
B=build/gpulib
timeout 90 $B/nodrop_cuda_fp8_bench --mode=training --iters=30 --shapes=mixtral,qwen3,dsv3,dsv3-down,mixtral-gate-up,mixtral-down 2>&1 | tee $OUT/r3/training-bench.md; el "six shapes in one process rc=${PIPESTATUS[0]}"
timeout 80 compute-sanitizer --tool initcheck --print-limit 3 $B/nodrop_cuda_fp8_bench --mode=training --iters=1 --warmup=0 --shapes=dsv3 > $OUT/r3/initcheck-dsv3.log 2>&1; el "initcheck dsv3 rc=$?"; grep -o "at void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<[^,]*, cutlass::gemm::collective::CollectiveMma<cutlass::gemm::[A-Za-z0-9]*" $OUT/r3/initcheck-dsv3.log | sort | uniq -c; tail -2 $OUT/r3/initcheck-dsv3.log
$B/nodrop_cuda_moe_tests --gtest_brief=1 --gtest_filter='*QuantizeFp8*' 2>&1 | tail -15; el "quantize tests rc=${PIPESTATUS[0]}"
for tool in memcheck racecheck; do
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 $B/nodrop_cuda_moe_tests --gtest_brief=1 \
    --gtest_filter='*QuantizeFp8*bf16*:*QuantizeFp8*Args*' 2>&1 | tail -4; el "$tool quantizers rc=${PIPESTATUS[0]}"
done
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache
cp $B/libnodrop_ffi_cuda.so nodrop/
left=$(( 560 - ($(date +%s) - start) ))
[ $left -gt 30 ] && timeout $left python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu.py -k "fp8" 2>&1 | tail -15; el "pytest fp8 rc=${PIPESTATUS[0]}"
