# GPU round 2 (2026-12-06): round 1's FFI libraries and a GPU test binary rebuilt with the AdamW
# test's NaN comparison fixed (build/gpulib/bin.tar.xz; oneDNN's runtime from
# build/gpulib/deps.tar.xz): the CUDA routing, permutation and AdamW tests with compute-sanitizer
# on the AdamW cases, then the training step on the preset round 1 had no time for, and again on
# the others with optax's step first.
set -u
BUDGET=${BUDGET:-570}
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
mkdir -p $OUT/r
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz --exclude='*tfevents*' --exclude='*.pb' --exclude='*trace.json.gz' \
           --exclude='tokenizer*' -C $OUT r; }
nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
tar xJf build/gpulib/deps.tar.xz -C / --skip-old-files
mkdir -p build/gpu && tar xJf build/gpulib/bin.tar.xz -C build/gpu
cp build/gpu/libnodrop_ffi_cuda.so build/gpu/libnodrop_ffi_cpu.so nodrop/
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NODROP_CACHE=/tmp/cache
build/gpu/nodrop_cuda_moe_tests --gtest_brief=1 > $OUT/r/moe-tests.log 2>&1
el "nodrop_cuda_moe_tests rc=$?"; tail -3 $OUT/r/moe-tests.log
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --error-exitcode 9 build/gpu/nodrop_cuda_moe_tests \
    --gtest_brief=1 --gtest_filter='*AdamWGpu*n1003*:*AdamWGpu*n196615*' 2>&1 | tail -4 \
    > $OUT/r/sanitizer-$tool.log
  el "compute-sanitizer $tool rc=${PIPESTATUS[0]}"; cat $OUT/r/sanitizer-$tool.log
done
pack
for run in ${RUNS:-deepseek:fused deepseek:optax qwen3:optax qwen3:fused mixtral:optax mixtral:fused}; do
  preset=${run%%:*}; version=${run#*:}
  [ $(left) -lt 60 ] && { el "no time for $preset $version"; break; }
  flag=--fused-adamw; [ $version = optax ] && flag=--no-fused-adamw
  timeout $(( $(left) - 15 )) python3 -m nodrop train --preset $preset --steps 40 $flag \
    --eval-every 40 --eval-batches 1 --checkpoint-every 0 --no-progress \
    --out /tmp/runs/$preset-$version > $OUT/r/train-$preset-$version.log 2>&1
  el "train $preset $version rc=$?"; tail -2 $OUT/r/train-$preset-$version.log
  mkdir -p $OUT/r/runs/$preset-$version && cp /tmp/runs/$preset-$version/*.json* \
    $OUT/r/runs/$preset-$version/ 2>/dev/null
  pack
done
el done
pack; rm -rf $OUT/r
