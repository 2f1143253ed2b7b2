# GPU round 4 (2026-12-07): where the Qwen3 FP8 layer's time goes now that the forward's weights
# are quantised by the engine (round 1 traced Mixtral): gpu_profile.py layer --fp8 tensorwise.
set -u
BUDGET=${BUDGET:-200}
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - start) - ${1:-10} )); }
mkdir -p $OUT/r
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz --exclude='trace-*' -C $OUT r; }
nvidia-smi -L
tar xJf build/gpulib/deps.tar.xz -C / --skip-old-files
mkdir -p build/gpu && tar xJf build/gpulib/bin.tar.xz -C build/gpu
cp build/gpu/libnodrop_ffi_cuda.so build/gpu/libnodrop_ffi_cpu.so nodrop/
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout $(left) python3 bench/gpu_profile.py layer --shapes Qwen3-30B-A3B --fp8 tensorwise \
  --out $OUT/r/layer-profile > $OUT/r/layer-profile.log 2>&1
el "gpu_profile.py layer rc=$?"; grep -E "^### " $OUT/r/layer-profile/layer-profile.md
el done
pack; rm -rf $OUT/r
