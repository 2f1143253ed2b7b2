# GPU round 3 (2026-12-07): permute_fp8 with a given scale on the engine's own tests
# (nodrop_cuda_moe_tests, every test: permute_rows_fp8 and the fill of unmapped rows changed) and
# under compute-sanitizer; its speed against the blockwise permute (nodrop_cuda_permute_bench);
# the MoE layer forward+backward in bf16 and in each FP8 recipe beside the capacity-factor layer
# (bench/gpu_moe.py --only layer).
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
build/gpu/nodrop_cuda_moe_tests --gtest_brief=1 > $OUT/r/moe-tests.log 2>&1
el "nodrop_cuda_moe_tests rc=$?"; tail -3 $OUT/r/moe-tests.log
for tool in memcheck racecheck; do
  timeout $(left 400) compute-sanitizer --tool $tool --error-exitcode 9 \
    build/gpu/nodrop_cuda_moe_tests --gtest_brief=1 --gtest_filter='*PermuteRowsFp8Gpu*' \
    > $OUT/r/sanitizer-$tool.log 2>&1
  el "compute-sanitizer $tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" $OUT/r/sanitizer-$tool.log | tail -3
done
pack
timeout $(left 330) build/gpu/nodrop_cuda_permute_bench > $OUT/r/permute-bench.txt 2>&1
el "nodrop_cuda_permute_bench rc=$?"; sed -n '/FP8 quantisation/,/^$/p' $OUT/r/permute-bench.txt
pack
timeout $(left) python3 bench/gpu_moe.py --only layer --out $OUT/r/gpu-moe-layer \
  > $OUT/r/gpu-moe-layer.log 2>&1
el "gpu_moe.py --only layer rc=$?"
sed -n '/## MoE expert layer, forward/,/## Targets/p' $OUT/r/gpu-moe-layer/gpu-moe.md 2>/dev/null | head -30
el done
pack; rm -rf $OUT/r
