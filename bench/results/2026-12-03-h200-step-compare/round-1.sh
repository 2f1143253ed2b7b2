# GPU round (2026-12-03, evening): issue 19's training-step target at main (df2ebd6): dropless
# against capacity factor 1.0 on the mixtral, qwen3 and deepseek presets, same model, seed and
# batches, one process per preset (`nodrop compare`, 50 steps, the default corpus, CUDA graphs on
# as users run). Python from the tree; the engine main's (build/gpulib/bundle.tar.xz: built on
# the development machine, nvcc 13.0, sm_90a, with the CPU engine's libraries).
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/sc/logs /tmp/b
L=$OUT/sc/logs
exec > >(tee -a $OUT/sc/round.log) 2>&1
tar xJf build/gpulib/bundle.tar.xz -C /tmp/b; B=/tmp/b
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$B/lib
cp $B/libnodrop_ffi_cuda.so $B/libnodrop_ffi_cpu.so nodrop/
for preset in mixtral qwen3 deepseek; do
  budget=$([ $preset = mixtral ] && echo 200 || ([ $preset = qwen3 ] && echo 380 || echo 560))
  timeout $(left $budget) python3 -m nodrop compare --preset $preset --steps 50 --seeds 0 \
    --capacity-factors 1.0 --eval-every 50 --eval-batches 2 --checkpoint-every 0 --no-progress \
    --out runs/compare-$preset > $L/compare-$preset.log 2>&1; el "compare $preset rc=$?"
  grep "^| " runs/compare-$preset/compare.md 2>/dev/null | head -8
done
tar czf $OUT/sc/compare.tgz -C runs compare-mixtral compare-qwen3 compare-deepseek 2>/dev/null; tar czf $OUT/sc/logs.tgz -C $OUT/sc logs && rm -rf $L; ls $OUT/sc
