# GPU round 1 (2026-12-03): FP8 with the weight gradient unquantised (--fp8-weight-gradient
# unquantised: the forward and the input gradient on the FP8 kernel, the weight gradient on
# nodrop's bf16 contraction) against the DeepSeek-V3 recipe's FP8 weight gradient and bf16:
# the GPU tests of the recipes, then `nodrop compare` on the mixtral and qwen3 presets.
# Binaries built on the development machine (nvcc 13.0, sm_90a), carried packed as
# build/gpulib/bundle.tar.xz (as round 7 of 2026-12-03-h200-fp8-quantisers).
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r1/logs /tmp/b
L=$OUT/r1/logs
exec > >(tee -a $OUT/r1/round.log) 2>&1
tar xJf build/gpulib/bundle.tar.xz -C /tmp/b; B=/tmp/b
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$B/lib
cp $B/libnodrop_ffi_cuda.so $B/libnodrop_ffi_cpu.so nodrop/
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu.py -k "fp8" > $L/test-gpu-fp8.log 2>&1; el "pytest test_gpu -k fp8 rc=$?"; tail -3 $L/test-gpu-fp8.log
for preset in mixtral qwen3; do
  timeout $(left $([ $preset = mixtral ] && echo 370 || echo 580)) python3 -m nodrop compare --preset $preset --steps 120 --seeds 0 \
    --fp8-recipes blockwise --fp8-weight-gradients fp8 unquantised --capacity-factors \
    --eval-every 20 --eval-batches 2 --checkpoint-every 0 --no-progress \
    --out runs/compare-$preset > $L/compare-$preset.log 2>&1; el "compare $preset rc=$?"
  grep "^| " runs/compare-$preset/compare.md 2>/dev/null | cut -d'|' -f2,3,8,9
done
tar czf $OUT/r1/compare.tgz -C runs compare-mixtral compare-qwen3 2>/dev/null; tar czf $OUT/r1/logs.tgz -C $OUT/r1 logs && rm -rf $L; ls $OUT/r1
