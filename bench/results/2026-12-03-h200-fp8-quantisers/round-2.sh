# GPU round 2 (2026-12-03), no build: the binaries of this commit built on the development
# machine (nvcc 13.0, sm_90a; the engine's sources are round 1's) and carried as build/gpulib.
# 1. The training benchmark one shape per process (round 1's run of six shapes in one process
#    stopped at the third with an illegal instruction, as on 2026-12-02).
# 2. bench/gpu_fp8.py: nodrop's FP8 forward against torch._scaled_grouped_mm.
# 3. That illegal instruction: the same three shapes with CUDA_LAUNCH_BLOCKING (the failing call
#    names itself), and compute-sanitizer initcheck on dsv3 alone (reads of unwritten memory).
# 4. The mixtral preset dropless in bf16 and in FP8 blockwise, one seed, same weights and batches.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r2
exec > >(tee -a $OUT/r2/round.log) 2>&1
B=build/gpulib
for s in mixtral qwen3 dsv3 dsv3-down mixtral-gate-up mixtral-down; do
  timeout 40 $B/nodrop_cuda_fp8_bench --mode=training --iters=30 --shapes=$s > $OUT/r2/training-$s.md 2>&1; el "training bench $s rc=$?"
done
grep -h "^| [a-z]" $OUT/r2/training-*.md | sort -u
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1
cp $B/libnodrop_ffi_cuda.so nodrop/
timeout $(left 250) python3 bench/gpu_fp8.py --out $OUT/r2 > $OUT/r2/gpu-fp8.log 2>&1; el "gpu_fp8 rc=$?"; tail -45 $OUT/r2/gpu-fp8.log
CUDA_LAUNCH_BLOCKING=1 timeout 45 $B/nodrop_cuda_fp8_bench --mode=training --iters=3 --warmup=1 --shapes=mixtral,qwen3,dsv3 2>&1 | tail -3; el "blocking mixtral,qwen3,dsv3 rc=${PIPESTATUS[0]}"
timeout 60 compute-sanitizer --tool initcheck --print-limit 5 $B/nodrop_cuda_fp8_bench --mode=training --iters=1 --warmup=0 --shapes=dsv3 > $OUT/r2/initcheck-dsv3.log 2>&1; el "initcheck dsv3 rc=$?"; head -c 2000 $OUT/r2/initcheck-dsv3.log; tail -2 $OUT/r2/initcheck-dsv3.log
timeout $(left 490) python3 -m nodrop compare --preset mixtral --steps 120 --seeds 0 --fp8-recipes blockwise \
  --capacity-factors --eval-every 20 --eval-batches 2 --checkpoint-every 0 \
  --out runs/compare > $OUT/r2/compare.log 2>&1; el "compare rc=$?"; grep -v "^\s*$" $OUT/r2/compare.log | tail -25
tar czf $OUT/r2/compare.tgz -C runs compare 2>/dev/null; ls $OUT/r2
