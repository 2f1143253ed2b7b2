# GPU round 3 (2026-12-02, session 9): the mixtral preset dropless in bf16 and in FP8 blockwise
# (forward, input and weight gradients on the FP8 kernels), same seed, weights and batches.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/r3
L=$OUT/r3/round.log; exec > >(tee -a $L) 2>&1
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache
cp build/gpulib/libnodrop_ffi_cuda.so nodrop/
STEPS=${STEPS:-120}
timeout 540 python3 -m nodrop compare --preset mixtral --steps $STEPS --seeds 0 1 2 --fp8-recipes blockwise \
  --capacity-factors --eval-every 20 --eval-batches 2 --checkpoint-every 0 \
  --out runs/compare3 2>&1 | grep -v "^\s*$" | tail -60
el "compare rc=${PIPESTATUS[0]}"
tar czf $OUT/r3/compare.tgz -C runs compare3 && ls -la $OUT/r3
