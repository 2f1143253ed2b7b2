# GPU round 1 (2026-12-06): the training step's tail (AdamW + the step's metrics) alone, before
# and after one-pass metrics (the first design: norm_and_finite), per preset, with each
# version's optimized HLO. No CUDA engine is
# needed (nodrop imports on its CPU engine, carried as build/gpulib/cpu.tar.xz with oneDNN).
set -u
mkdir -p $OUT/r /tmp/v
exec > >(tee -a $OUT/r/round.log) 2>&1
tar xJf build/gpulib/cpu.tar.xz -C /tmp/v
cp /tmp/v/lib/libnodrop_ffi_cpu.so nodrop/
export LD_LIBRARY_PATH=/tmp/v/lib PYTHONUNBUFFERED=1
nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
timeout 420 python3 bench/results/2026-12-06-optimizer-pass/tail_bench.py qwen3 mixtral deepseek \
  --out $OUT/r/tail
echo "rc=$?"
tar czf $OUT/r.tgz -C $OUT r
