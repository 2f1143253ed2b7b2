# GPU round 3 (2026-12-07): the tensorwise recipe's weight gradient, unquantised (the default)
# or FP8, on the `qwen3` and `deepseek` presets, with the forward's weights quantised by the
# engine: 80 steps each, seed 0, the same weights and batches, beside dropless bf16 (round 2
# measured `mixtral`).
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
for preset in qwen3 deepseek; do
  [ $preset = qwen3 ] && reserve=250 || reserve=0
  timeout $(left $reserve) python3 -m nodrop compare --preset $preset --steps 80 \
    --capacity-factors --fp8-recipes tensorwise --fp8-weight-gradients unquantised fp8 \
    --eval-every 40 --eval-batches 2 --checkpoint-every 0 --no-progress \
    --out $OUT/r/compare-$preset > $OUT/r/compare-$preset.log 2>&1
  el "nodrop compare --preset $preset rc=$?"
  sed -n '/^| run/,/^$/p' $OUT/r/compare-$preset/compare.md 2>/dev/null
  pack
done
el done
pack; rm -rf $OUT/r
