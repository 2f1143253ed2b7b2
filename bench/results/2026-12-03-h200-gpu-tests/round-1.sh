# GPU round (2026-12-03, evening): the JAX GPU suite (tests/python/test_gpu.py) at main (18c31cc), after the
# bilinear-JVP merge (f74688d), with command buffers on for custom calls as scripts/gpu-check.sh
# runs it. Engine: main's (build/gpulib/bundle.tar.xz, nvcc 13.0, sm_90a).
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/gt /tmp/b
exec > >(tee -a $OUT/gt/round.log) 2>&1
tar xJf build/gpulib/bundle.tar.xz -C /tmp/b; B=/tmp/b
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$B/lib
cp $B/libnodrop_ffi_cuda.so $B/libnodrop_ffi_cpu.so nodrop/
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  timeout 480 python3 -m pytest -q -p no:cacheprovider -rfs tests/python/test_gpu.py > $OUT/gt/pytest-gpu.log 2>&1
el "pytest test_gpu.py rc=$?"; tail -15 $OUT/gt/pytest-gpu.log
