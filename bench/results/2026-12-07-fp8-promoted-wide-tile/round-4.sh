# GPU round 4 (2026-12-07): where the FP8 layer's time goes. Round 3 measured the MoE layer in
# the tensorwise recipe at 1.05x bf16 (Mixtral) and 0.89x (Qwen3) while its GEMMs alone run
# 1.2-1.6x; this traces the layer's forward+backward kernel by kernel, bf16, tensorwise and
# capacity 1.0 (bench/gpu_profile.py layer --fp8 tensorwise).
set -u
BUDGET=${BUDGET:-400}
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - start) - ${1:-10} )); }
mkdir -p $OUT/r
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz -C $OUT r --exclude='trace-*'; }
nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
tar xJf build/gpulib/deps.tar.xz -C / --skip-old-files
mkdir -p build/gpu && tar xJf build/gpulib/bin.tar.xz -C build/gpu
cp build/gpu/libnodrop_ffi_cuda.so build/gpu/libnodrop_ffi_cpu.so nodrop/
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout $(left) python3 bench/gpu_profile.py layer --shapes Mixtral-8x7B,Qwen3-30B-A3B \
  --fp8 tensorwise --out $OUT/r/layer-profile > $OUT/r/layer-profile.log 2>&1
el "gpu_profile.py layer rc=$?"; grep -E "^### " $OUT/r/layer-profile/layer-profile.md
el done
pack; rm -rf $OUT/r
