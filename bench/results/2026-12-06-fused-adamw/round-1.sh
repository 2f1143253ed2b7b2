# GPU round 1 (2026-12-06): the CUDA engine built beforehand (build/gpulib/bin.tar.xz), or else
# built on the GPU machine (CUTLASS's wheel, oneDNN and GoogleTest carried in build/gpulib/); the
# oneDNN runtime from build/gpulib/deps.tar.xz. Then the AdamW kernel's GPU tests (bitwise against the
# CPU engine) with compute-sanitizer memcheck and racecheck, the JAX op's GPU tests, the
# optimizer benchmark (bench/gpu_optimizer.py) on the three GPU presets, then the training step
# with the fused step and with optax's, alternating order. A library built here is packed for round 2.
set -u
BUDGET=${BUDGET:-570}
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
mkdir -p $OUT/r
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz --exclude='*tfevents*' --exclude='*.pb' --exclude='*trace.json.gz' \
           --exclude='tokenizer*' -C $OUT r; }
nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
git log -1 --format='commit %H' 2>/dev/null
tar xJf build/gpulib/deps.tar.xz -C / --skip-old-files
if [ -f build/gpulib/bin.tar.xz ]; then  # built beforehand (a fresh-clone CI build, sm_90a)
  mkdir -p build/gpu && tar xJf build/gpulib/bin.tar.xz -C build/gpu
else
  python3 -m pip install -q --no-deps --no-index --target /tmp/cutlass \
    build/gpulib/nvidia_cutlass-4.2.0.0-py3-none-any.whl
  cmake -S . -B build/gpu -G Ninja -DNODROP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release \
    -DNODROP_CUTLASS_DIR=/tmp/cutlass/cutlass_library/source > $OUT/r/cmake.log 2>&1
  el "cmake rc=$?"; tail -3 $OUT/r/cmake.log
  cmake --build build/gpu -j16 --target nodrop_ffi_cuda nodrop_ffi_cpu nodrop_cuda_moe_tests \
    > $OUT/r/build.log 2>&1
  el "build rc=$?"; grep -E 'error|FAILED' $OUT/r/build.log | head -20
  mkdir -p $OUT/lib && for lib in libnodrop_ffi_cuda.so libnodrop_ffi_cpu.so; do
    strip -o $OUT/lib/$lib build/gpu/$lib; done \
    && tar cJf $OUT/lib.tar.xz -C $OUT/lib . && rm -rf $OUT/lib
fi
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
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu.py -k adamw \
  > $OUT/r/pytest-gpu.log 2>&1
el "pytest test_gpu.py -k adamw rc=$?"; tail -2 $OUT/r/pytest-gpu.log
pack
timeout 150 python3 bench/gpu_optimizer.py qwen3 mixtral deepseek --out $OUT/r/optimizer \
  --iters 10 > $OUT/r/optimizer.log 2>&1
el "optimizer bench rc=$?"; cat $OUT/r/optimizer/optimizer.md 2>/dev/null || tail -5 $OUT/r/optimizer.log
pack
for preset in qwen3 mixtral; do
  for version in fused optax; do
    [ $(left) -lt 60 ] && { el "no time for $preset $version"; break 2; }
    flag=--fused-adamw; [ $version = optax ] && flag=--no-fused-adamw
    timeout $(( $(left) - 15 )) python3 -m nodrop train --preset $preset --steps 40 $flag \
      --eval-every 40 --eval-batches 1 --checkpoint-every 0 --no-progress \
      --out /tmp/runs/$preset-$version > $OUT/r/train-$preset-$version.log 2>&1
    el "train $preset $version rc=$?"; tail -2 $OUT/r/train-$preset-$version.log
    mkdir -p $OUT/r/runs/$preset-$version && cp /tmp/runs/$preset-$version/*.json* \
      $OUT/r/runs/$preset-$version/ 2>/dev/null
  done
  pack
done
el done
pack; rm -rf $OUT/r
