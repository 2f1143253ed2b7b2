# GPU round 2 (2026-12-03): the tensorwise recipe with its weight gradient unquantised, which
# takes away its XLA gather and transpose of the weight gradient's codes, against tensorwise as
# it was and bf16, on the mixtral preset (as round 1; the same carried binaries).
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/r2/logs /tmp/b
L=$OUT/r2/logs
exec > >(tee -a $OUT/r2/round.log) 2>&1
tar xJf build/gpulib/bundle.tar.xz -C /tmp/b; B=/tmp/b
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$B/lib
cp $B/libnodrop_ffi_cuda.so $B/libnodrop_ffi_cpu.so nodrop/
timeout 400 python3 -m nodrop compare --preset mixtral --steps 120 --seeds 0 \
  --fp8-recipes tensorwise --fp8-weight-gradients fp8 unquantised --capacity-factors \
  --eval-every 20 --eval-batches 2 --checkpoint-every 0 --no-progress \
  --out runs/compare-mixtral-tensorwise > $L/compare.log 2>&1; el "compare rc=$?"
grep "^| " runs/compare-mixtral-tensorwise/compare.md | cut -d'|' -f2,3,8,9
tar czf $OUT/r2/compare.tgz -C runs compare-mixtral-tensorwise; tar czf $OUT/r2/logs.tgz -C $OUT/r2 logs && rm -rf $L; ls $OUT/r2
