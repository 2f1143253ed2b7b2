# GPU round 4 (2026-12-07, session 6): the training step with the tile rule of this change
# (`after`: forwards and input gradients of >= 1024 rows per group on the cooperative 128x256
# tile on GPUs under 4 TB/s) against main's (`before`, build/gpulib/bin.tar.xz), the same card,
# in turns: 40 steps of `mixtral`, `qwen3` and `deepseek`, dropless bf16, and `mixtral` at capacity
# factor 1.0. Each run from its own copy of the package (cwd and PYTHONPATH /tmp/before or
# /tmp/after).
set -u
BUDGET=${BUDGET:-560}
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - start) - ${1:-10} )); }
mkdir -p $OUT/r
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
tar xJf build/gpulib/deps.tar.xz -C / --skip-old-files
mkdir -p build/before build/after
tar xJf build/gpulib/bin.tar.xz -C build/before && tar xJf build/gpulib/after.tar.xz -C build/after
for v in before after; do
  mkdir -p /tmp/$v && cp -r nodrop /tmp/$v/ && cp build/$v/libnodrop_ffi_cuda.so build/$v/libnodrop_ffi_cpu.so /tmp/$v/nodrop/
done
export PYTHONUNBUFFERED=1
run() {  # variant, name, args...
  local v=$1 name=$2; shift 2
  (cd /tmp/$v && PYTHONPATH=/tmp/$v timeout $(left 40) python3 -m nodrop train --steps 40 --eval-every 40 \
    --eval-batches 1 --checkpoint-every 0 --no-progress "$@" --out /tmp/runs/$v-$name \
    > $OUT/r/$v-$name.log 2>&1)
  el "$v $name rc=$?: $(grep -E 'tokens/s over' $OUT/r/$v-$name.log | tail -1)"
}
run before mixtral-1 --preset mixtral
run after mixtral-1 --preset mixtral
run after qwen3 --preset qwen3
run before qwen3 --preset qwen3
run before deepseek --preset deepseek
run after deepseek --preset deepseek
pack
run after mixtral-cap1 --preset mixtral --capacity-factor 1.0
el done
pack; rm -rf $OUT/r
