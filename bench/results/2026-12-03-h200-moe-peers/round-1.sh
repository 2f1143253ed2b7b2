# GPU round (2026-12-03): bench/gpu_moe.py in full, with tokamax.ragged_dot beside
# torch._grouped_mm and jax.lax.ragged_dot (the run of 2026-12-02-h200-tokamax was cut short):
# the MoE layer (nodrop dropless, capacity 1.0 and 1.25, a layer on tokamax; activation memory),
# then the grouped matmul one shape per process, so that a time limit loses one shape at most.
# tokamax 0.0.17 and the pure-Python packages it imports (pip install --no-deps --target on the
# development machine; xprof without its web assets and events database) travel as
# build/gpulib/tokamax-deps.tar.xz; nodrop's engine as build/gpulib/bundle.tar.xz (nvcc 13.0,
# sm_90a).
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/m1/logs /tmp/b /tmp/tk
L=$OUT/m1/logs
exec > >(tee -a $OUT/m1/round.log) 2>&1
tar xJf build/gpulib/bundle.tar.xz -C /tmp/b; tar xJf build/gpulib/tokamax-deps.tar.xz -C /tmp/tk
export PYTHONPATH=$PWD:/tmp/tk/tkdeps NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=/tmp/b/lib
cp /tmp/b/libnodrop_ffi_cuda.so /tmp/b/libnodrop_ffi_cpu.so nodrop/
python3 -c "import tokamax, torch, jax; print('tokamax imports; torch', torch.__version__, 'jax', jax.__version__, jax.devices())"; el "imports"
timeout $(left 250) python3 bench/gpu_moe.py --only layer --out runs/layer > $L/layer.log 2>&1; el "layer rc=$?"
grep -v "^WARNING:absl" $L/layer.log | tail -25
for shape in Mixtral-8x7B Qwen3-30B-A3B DeepSeek-V2-Lite DeepSeek-V3-EP8; do
  timeout $(left 585) python3 bench/gpu_moe.py --only gemm --shapes $shape --out runs/gemm-$shape > $L/gemm-$shape.log 2>&1; el "gemm $shape rc=$?"
done
grep -h -v "^WARNING:absl" $L/gemm-*.log | grep "^|" | head -60
tar czf $OUT/m1/runs.tgz -C runs layer $(cd runs && ls -d gemm-* 2>/dev/null); tar czf $OUT/m1/logs.tgz -C $OUT/m1 logs && rm -rf $L; ls $OUT/m1
