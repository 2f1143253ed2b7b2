# GPU round 1 (2026-12-07): the FP8 tensorwise grouped GEMM (fast accumulation), built beforehand
# (build/gpulib/bin.tar.xz) or else on the GPU machine (CUTLASS's wheel, oneDNN and GoogleTest
# carried in build/gpulib/; the binaries then packed for round 2), then its engine tests
# and every other FP8 kernel's (nodrop_cuda_tests '*Fp8*'), the AdamW engine tests (NaN
# compared as NaN since 2026-12-06), the forward benchmark of every FP8 kernel against bf16
# (nodrop_cuda_fp8_bench --configs=all), bench/gpu_fp8.py against torch, then the JAX FP8 GPU
# tests as time allows.
set -u
BUDGET=${BUDGET:-570}
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/r
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
tar xJf build/gpulib/deps.tar.xz -C / --skip-old-files
if [ -f build/gpulib/bin.tar.xz ]; then  # built beforehand on the CPU machine, for sm_90a
  mkdir -p build/gpu && tar xJf build/gpulib/bin.tar.xz -C build/gpu
else
  python3 -m pip install -q --no-deps --no-index --target /tmp/cutlass \
    build/gpulib/nvidia_cutlass-4.2.0.0-py3-none-any.whl
  cmake -S . -B build/gpu -G Ninja -DNODROP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release \
    -DNODROP_CUTLASS_DIR=/tmp/cutlass/cutlass_library/source > $OUT/r/cmake.log 2>&1
  el "cmake rc=$?"; tail -3 $OUT/r/cmake.log
  cmake --build build/gpu -j16 --target nodrop_cuda_tests nodrop_cuda_moe_tests \
    nodrop_cuda_fp8_bench nodrop_ffi_cuda nodrop_ffi_cpu > $OUT/r/build.log 2>&1
  el "build rc=$?"; grep -E 'error|FAILED|warning' $OUT/r/build.log | head -20
  mkdir -p $OUT/bin && for f in libnodrop_ffi_cuda.so libnodrop_ffi_cpu.so nodrop_cuda_tests \
    nodrop_cuda_moe_tests nodrop_cuda_fp8_bench; do strip -o $OUT/bin/$f build/gpu/$f; done \
    && tar cJf $OUT/bin.tar.xz -C $OUT/bin . && rm -rf $OUT/bin
fi
cp build/gpu/libnodrop_ffi_cuda.so build/gpu/libnodrop_ffi_cpu.so nodrop/
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
pack
build/gpu/nodrop_cuda_tests --gtest_brief=1 --gtest_filter='*Fp8*' > $OUT/r/fp8-tests.log 2>&1
el "nodrop_cuda_tests *Fp8* rc=$?"; tail -4 $OUT/r/fp8-tests.log
build/gpu/nodrop_cuda_moe_tests --gtest_brief=1 --gtest_filter='*AdamW*' > $OUT/r/adamw-tests.log 2>&1
el "nodrop_cuda_moe_tests *AdamW* rc=$?"; tail -3 $OUT/r/adamw-tests.log
pack
build/gpu/nodrop_cuda_fp8_bench --configs=all > $OUT/r/fp8-bench.md 2>&1
el "nodrop_cuda_fp8_bench --configs=all rc=$?"; sed -n '/Best FP8/,$p' $OUT/r/fp8-bench.md
pack
left=$(( BUDGET - ($(date +%s) - start) - 70 ))
[ $left -gt 300 ] && left=300
timeout $left python3 bench/gpu_fp8.py --out $OUT/r/gpu-fp8 > $OUT/r/gpu-fp8.log 2>&1
el "gpu_fp8.py rc=$?"; sed -n '/## Targets/,$p' $OUT/r/gpu-fp8/gpu-fp8.md 2>/dev/null | head -40
pack
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  timeout $(( BUDGET - ($(date +%s) - start) - 10 )) python3 -m pytest -q -p no:cacheprovider \
  tests/python/test_gpu.py -k fp8 > $OUT/r/pytest-gpu.log 2>&1
el "pytest test_gpu.py -k fp8 rc=$?"; tail -3 $OUT/r/pytest-gpu.log
pack
el done
pack; rm -rf $OUT/r
