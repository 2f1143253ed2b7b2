# GPU round 2 (2026-12-07): the promoted weight-gradient tile round 1 settled (128x192 on a 2x1
# cluster) as the automatic choice, and permute_fp8 with a given scale (the tensorwise recipe's
# rows quantised as they are permuted): the FP8 engine tests and compute-sanitizer on the
# permute kernel; a layer's three GEMMs against bf16 (nodrop_cuda_fp8_bench --mode=training,
# automatic kernels); 120 steps of `mixtral` in bf16 and in the tensorwise recipe with both
# weight gradients, same weights and batches; the JAX FP8 GPU tests.
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
el "nodrop_cuda_tests *Fp8* rc=$?"; tail -3 $OUT/r/fp8-tests.log
for tool in memcheck racecheck; do
  timeout $(left 450) compute-sanitizer --tool $tool --error-exitcode 9 \
    build/gpu/nodrop_cuda_tests --gtest_brief=1 --gtest_filter='*PermuteRowsFp8Gpu*' \
    > $OUT/r/sanitizer-$tool.log 2>&1
  el "compute-sanitizer $tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" $OUT/r/sanitizer-$tool.log | tail -3
done
pack
timeout $(left 420) build/gpu/nodrop_cuda_fp8_bench --mode=training \
  > $OUT/r/fp8-training-bench.md 2>&1
el "nodrop_cuda_fp8_bench --mode=training rc=$?"
sed -n '/tensorwise recipe/,/^$/p' $OUT/r/fp8-training-bench.md | head -16
pack
timeout $(left 240) python3 -m nodrop compare --preset mixtral --steps 120 --capacity-factors \
  --fp8-recipes tensorwise --fp8-weight-gradients unquantised fp8 --eval-every 40 \
  --eval-batches 2 --checkpoint-every 0 --out $OUT/r/compare > $OUT/r/compare.log 2>&1
el "nodrop compare rc=$?"; sed -n '/^| run/,/^$/p' $OUT/r/compare/compare.md 2>/dev/null
pack
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  timeout $(left) python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu.py -k fp8 \
  > $OUT/r/pytest-gpu.log 2>&1
el "pytest test_gpu.py -k fp8 rc=$?"; tail -3 $OUT/r/pytest-gpu.log
el done
pack; rm -rf $OUT/r
