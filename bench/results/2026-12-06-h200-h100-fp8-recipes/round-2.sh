# GPU round 2 (2026-12-06). Issue 18, after round 1 showed the bf16 weight gradient faster than
# the FP8 one with its transposed quantisation on 10 of 12 layer shapes and `mixtral` training
# faster with it: the recipes' default weight gradient became "unquantised". Binaries built on
# the development machine (nvcc 13.0, sm_90a, stripped) and carried as build/gpulib/r2.tar.xz:
# the engine libraries of round 1 and nodrop_cuda_fp8_bench with the unquantised weight
# gradient's layer timed in the same run (two new columns).
# 1. nodrop_cuda_fp8_bench --mode=training, every shape.
# 2. nodrop compare, qwen3 and deepseek: bf16, FP8 blockwise (the new default) and FP8 blockwise
#    with FP8 weight gradients, 120 steps, same seed and batches.
set -u
BUDGET=${BUDGET:-580}  # seconds the whole round may take
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r/logs /tmp/v
L=$OUT/r/logs
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz -C $OUT r/logs r/round.log 2>/dev/null
         tar czf $OUT/compare.tgz --exclude='*tfevents*' --exclude='tokenizer*' -C runs \
           compare-qwen3 compare-deepseek 2>/dev/null; }
tar xJf build/gpulib/r2.tar.xz -C /tmp/v
nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
export LD_LIBRARY_PATH=/tmp/v/lib
timeout 120 /tmp/v/nodrop_cuda_fp8_bench --mode=training > $L/fp8-training-bench.md 2>&1
el "fp8 bench rc=$?"; cat $L/fp8-training-bench.md
pack
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1
cp /tmp/v/libnodrop_ffi_cuda.so /tmp/v/libnodrop_ffi_cpu.so nodrop/
for preset in qwen3 deepseek; do
  timeout $(left $BUDGET) python3 -m nodrop compare --preset $preset --steps 120 --seeds 0 \
    --fp8-recipes blockwise --fp8-weight-gradients unquantised fp8 --capacity-factors \
    --eval-every 20 --eval-batches 2 --checkpoint-every 0 --no-progress \
    --out runs/compare-$preset > $L/compare-$preset.log 2>&1
  el "compare $preset rc=$?"; grep "^| " runs/compare-$preset/compare.md 2>/dev/null
  pack
done
el done
