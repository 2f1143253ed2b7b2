# GPU round 2 (2026-12-07, session 7): round 1's A/B again with the other setting first, two
# identical short runs (are the GPU runs deterministic step to step?), and a traced qwen3 step
# with each setting (bench/gpu_profile.py: where the time saved comes from). The same
# libraries as round 1 (build/gpulib/grads.tar.xz). Not run yet: no GPU was lent after round 1.
set -u
BUDGET=${BUDGET:-440}
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - start) - ${1:-10} )); }
mkdir -p $OUT/r
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz --exclude='*tfevents*' --exclude='*.pb' --exclude='*trace.json.gz' \
           --exclude='tokenizer*' -C $OUT r; }
nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
tar xJf build/gpulib/deps.tar.xz -C / --skip-old-files
mkdir -p build/gpu && tar xJf build/gpulib/grads.tar.xz -C build/gpu
cp build/gpu/libnodrop_ffi_cuda.so build/gpu/libnodrop_ffi_cpu.so nodrop/
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NODROP_CACHE=/tmp/cache

run() {  # name, flags...
  local name=$1; shift
  [ $(left 50) -lt 0 ] && { el "no time for $name"; return; }
  timeout $(left 10) python3 -m nodrop train --eval-batches 1 --checkpoint-every 0 \
    --no-progress "$@" --out /tmp/runs/$name > $OUT/r/train-$name.log 2>&1
  el "train $name rc=$?: $(grep -E 'tokens/s over' $OUT/r/train-$name.log | tail -1)"
  mkdir -p $OUT/r/runs/$name && cp /tmp/runs/$name/*.json* $OUT/r/runs/$name/ 2>/dev/null
  pack
}
A="--steps 40 --eval-every 40"
run qwen3-off $A --preset qwen3 --no-compute-dtype-gradients
run qwen3-on $A --preset qwen3 --compute-dtype-gradients
run mixtral-on $A --preset mixtral --compute-dtype-gradients
run mixtral-off $A --preset mixtral --no-compute-dtype-gradients
run deepseek-off $A --preset deepseek --no-compute-dtype-gradients
run deepseek-on $A --preset deepseek --compute-dtype-gradients
run qwen3-off-3a --steps 3 --eval-every 3 --preset qwen3 --no-compute-dtype-gradients
run qwen3-off-3b --steps 3 --eval-every 3 --preset qwen3 --no-compute-dtype-gradients
P="--steps 26 --eval-every 26 --profile 21:23"
XLA_FLAGS=--xla_gpu_enable_command_buffer= run qwen3-on-trace $P --preset qwen3 --compute-dtype-gradients
XLA_FLAGS=--xla_gpu_enable_command_buffer= run qwen3-off-trace $P --preset qwen3 --no-compute-dtype-gradients
if [ $(left 40) -gt 0 ]; then
  timeout $(left 5) python3 bench/gpu_profile.py runs /tmp/runs/qwen3-on-trace \
    /tmp/runs/qwen3-off-trace --out $OUT/r/qwen3-profile > $OUT/r/profile-qwen3.log 2>&1
  el "profile qwen3 rc=$?"; tail -3 $OUT/r/profile-qwen3.log
fi
el done
pack; rm -rf $OUT/r
