# GPU round 1 (2026-12-07, session 6): where the `mixtral` training step's time goes at HEAD
# (after the fused AdamW, the one-pass metrics and the router on tensor cores), bf16 dropless
# against capacity factor 1.0 and the FP8 tensorwise recipe, traced kernel by kernel; `qwen3`
# bf16 dropless too; then the FP8 benchmark's weights tables with both layouts (not rerun when
# the in-place quantiser landed). XLA's command buffers are off in the traced runs so that every
# kernel names its HLO op (bench/results/2026-12-02-h200-step-profile/README.md).
set -u
BUDGET=${BUDGET:-580}
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - start) - ${1:-10} )); }
mkdir -p $OUT/r
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz --exclude='trace-*' --exclude='*.xplane.pb' --exclude='*.trace.json.gz' -C $OUT r; }
nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
tar xJf build/gpulib/deps.tar.xz -C / --skip-old-files
mkdir -p build/gpu && tar xJf build/gpulib/bin.tar.xz -C build/gpu
cp build/gpu/libnodrop_ffi_cuda.so build/gpu/libnodrop_ffi_cpu.so nodrop/
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T="--steps 26 --eval-every 26 --eval-batches 1 --checkpoint-every 0 --no-progress --profile 21:23"
run() {  # name, args...
  local name=$1; shift
  XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout $(left 60) python3 -m nodrop train $T "$@" \
    --out /tmp/runs/$name > $OUT/r/$name.log 2>&1
  el "train $name rc=$?"; grep -iE "tokens/s" $OUT/r/$name.log | tail -2
}
run mixtral --preset mixtral
run mixtral-cap1 --preset mixtral --capacity-factor 1.0
timeout $(left 40) python3 bench/gpu_profile.py runs /tmp/runs/mixtral /tmp/runs/mixtral-cap1 --out $OUT/r/mixtral > $OUT/r/profile-mixtral.log 2>&1
el "profile mixtral rc=$?"; pack
run mixtral-fp8 --preset mixtral --fp8 tensorwise
timeout $(left 40) python3 bench/gpu_profile.py runs /tmp/runs/mixtral /tmp/runs/mixtral-fp8 --out $OUT/r/mixtral-fp8 > $OUT/r/profile-mixtral-fp8.log 2>&1
el "profile mixtral-fp8 rc=$?"; pack
run qwen3 --preset qwen3
timeout $(left 40) python3 bench/gpu_profile.py runs /tmp/runs/qwen3 --out $OUT/r/qwen3 > $OUT/r/profile-qwen3.log 2>&1
el "profile qwen3 rc=$?"; pack
timeout $(left 15) build/gpu/nodrop_cuda_fp8_bench --mode=training > $OUT/r/fp8-training-bench.md 2> $OUT/r/fp8-training-bench.err
el "fp8 bench rc=$?"
el done
pack; rm -rf $OUT/r
