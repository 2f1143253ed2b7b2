# GPU round 7 (2026-12-03): the training benchmark after its fix (the input gradient's [M, K]
# output had an [M, N] buffer, and qwen3 and dsv3 have K > N), all six shapes in one process,
# for 4 (the tree), 8 and 16 tiles per transposed-quantiser thread block (t8, t16: only
# kTilesPerThreadBlock changed); the forward benchmark; memcheck of qwen3 then dsv3 in one
# process; test_fp8.py's kernel tests on the GPU machine as `make test-python` now runs them
# (JAX_PLATFORMS=cpu) and, once, on the GPU. Binaries built on the development machine (nvcc
# 13.0, sm_90a), stripped, with the CPU engine's libraries, carried as build/gpulib/bundle.tar.xz.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/r7/logs /tmp/b
L=$OUT/r7/logs
exec > >(tee -a $OUT/r7/round.log) 2>&1
tar xJf build/gpulib/bundle.tar.xz -C /tmp/b; B=/tmp/b
S=mixtral,qwen3,dsv3,dsv3-down,mixtral-gate-up,mixtral-down
for v in t4 t8 t16; do
  bin=$B/nodrop_cuda_fp8_bench; [ $v != t4 ] && bin=$B/$v/nodrop_cuda_fp8_bench
  timeout 120 $bin --mode=training --iters=30 --shapes=$S > $L/training-$v.md 2>&1; el "training $v rc=$?"
done
for v in t4 t8 t16; do echo "tiles per thread block: $v"; grep -h "^| [a-z]" $L/training-$v.md; done
timeout 150 $B/nodrop_cuda_fp8_bench --iters=30 > $L/forward.md 2>&1; el "forward rc=$?"; cat $L/forward.md
timeout 150 compute-sanitizer --tool memcheck --print-limit 5 $B/nodrop_cuda_fp8_bench --mode=training --iters=1 --warmup=0 --shapes=qwen3,dsv3 > $L/memcheck-qwen3-dsv3.log 2>&1; el "memcheck qwen3,dsv3 rc=$?"; tail -3 $L/memcheck-qwen3-dsv3.log
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$B/lib
cp $B/libnodrop_ffi_cuda.so $B/libnodrop_ffi_cpu.so nodrop/
K="kernel_forward_and_gradients or no_groups or weight_gradient or checked_mode"
JAX_PLATFORMS=cpu timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/python/test_fp8.py -k "$K" > $L/test-fp8-cpu-platform.log 2>&1; el "test_fp8.py with JAX_PLATFORMS=cpu rc=$?"; tail -3 $L/test-fp8-cpu-platform.log
timeout 100 python3 -m pytest -q -x -p no:cacheprovider --tb=short tests/python/test_fp8.py -k "$K and not property" > $L/test-fp8-gpu-platform.log 2>&1; el "test_fp8.py on the GPU, first failure rc=$?"; grep -E "^E |Error|passed|failed" $L/test-fp8-gpu-platform.log | cut -c1-300 | head -20
tar czf $OUT/r7/logs.tgz -C $OUT/r7 logs && rm -rf $L; ls $OUT/r7
