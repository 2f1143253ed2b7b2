# GPU round 2 (2026-12-07): training with the forward's weights quantised by the engine. 120
# steps of `mixtral`, seed 0, the same weights and batches: dropless bf16, capacity factor 1.0,
# and dropless in the tensorwise and blockwise recipes, each with the weight gradient unquantised
# (the default) and in FP8; then the tensorwise run again on HEAD 3fc33e9's nodrop/ops/fp8.py
# (build/gpulib/fp8_before.py), the same card, for the change's own effect.
set -u
BUDGET=${BUDGET:-570}
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
mkdir -p /tmp/before && cp -r nodrop /tmp/before/ && cp build/gpulib/fp8_before.py /tmp/before/nodrop/ops/fp8.py
timeout $(left 100) python3 -m nodrop compare --preset mixtral --steps 120 --capacity-factors 1.0 \
  --fp8-recipes tensorwise blockwise --fp8-weight-gradients unquantised fp8 --eval-every 40 --eval-batches 2 --checkpoint-every 0 \
  --no-progress --out $OUT/r/compare > $OUT/r/compare.log 2>&1
el "nodrop compare rc=$?"; sed -n '/^| run/,/^$/p' $OUT/r/compare/compare.md 2>/dev/null
pack
PYTHONPATH=/tmp/before timeout $(left) python3 -m nodrop train --preset mixtral --steps 120 \
  --fp8 tensorwise --eval-every 40 --eval-batches 2 --checkpoint-every 0 --no-progress \
  --out $OUT/r/before-tensorwise > $OUT/r/before-tensorwise.log 2>&1
el "nodrop train (before, tensorwise) rc=$?"; grep -iE "tokens/s|val" $OUT/r/before-tensorwise.log | tail -4
el done
pack; rm -rf $OUT/r
