# GPU round 6 (2026-12-04): main at 33dc926 (the transposed quantiser's fast path for thread
# blocks past the groups) on the GPU suites. build/gpulib/bundle.tar.xz: 33dc926's
# libnodrop_ffi_{cuda,cpu}.so, nodrop_cuda_tests and nodrop_cuda_moe_tests (nvcc 13.0, sm_90a,
# stripped) and the oneDNN and OpenCL loaders the CPU library links.
#   1. the JAX GPU suite, tests/python/test_gpu.py, command buffers on for custom calls (as
#      scripts/gpu-check.sh runs it): its FP8 tests run the quantisers through XLA;
#   2. both GoogleTest binaries in full.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/gt /tmp/b
exec > >(tee -a $OUT/gt/round.log) 2>&1
pack() { tar czf $OUT/gt.tgz -C $OUT gt 2>/dev/null; }
tar xJf build/gpulib/bundle.tar.xz -C /tmp/b; B=/tmp/b
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$B/lib
cp $B/libnodrop_ffi_cuda.so $B/libnodrop_ffi_cpu.so nodrop/
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  timeout 330 python3 -m pytest -q -p no:cacheprovider -rfs tests/python/test_gpu.py > $OUT/gt/pytest-gpu.log 2>&1
el "pytest test_gpu.py rc=$?"; tail -8 $OUT/gt/pytest-gpu.log
pack
for t in nodrop_cuda_moe_tests nodrop_cuda_tests; do
  timeout 110 $B/$t --gtest_brief=1 > $OUT/gt/$t.log 2>&1
  el "$t rc=$?"; tail -3 $OUT/gt/$t.log
  pack
done
el done
