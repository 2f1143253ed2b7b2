# GPU round (2026-12-03): is the MoE layer's drop against capacity 1.0 (Qwen3 1.01x on
# 2026-12-01, 0.96x in 2026-12-03-h200-moe-peers) in the code or in the card? The Python of
# 849131f (the 2026-12-01 architecture round's commit; `nodrop/` and `bench/`, carried as
# build/gpulib/old-849131f.tar.xz) against this tree's, on one card, in turns (new, old, new),
# both on this tree's engine (build/gpulib/bundle.tar.xz): so only what changed above the
# engine (the ops as JAX primitives, MoEBlock, the benchmark) can differ.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/ab/logs /tmp/b /tmp/o
L=$OUT/ab/logs
exec > >(tee -a $OUT/ab/round.log) 2>&1
tar xJf build/gpulib/bundle.tar.xz -C /tmp/b; tar xJf build/gpulib/old-849131f.tar.xz -C /tmp/o
export NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=/tmp/b/lib
cp /tmp/b/libnodrop_ffi_cuda.so /tmp/b/libnodrop_ffi_cpu.so nodrop/
cp /tmp/b/libnodrop_ffi_cuda.so /tmp/b/libnodrop_ffi_cpu.so /tmp/o/old/nodrop/
NEW=$PWD
run() {  # run TREE LABEL
  (cd $1 && PYTHONPATH=$1 timeout $(left 280) python3 bench/gpu_moe.py --only layer \
     --shapes Qwen3-30B-A3B --out $NEW/runs/$2 > $L/$2.log 2>&1); el "$2 rc=$?"
  grep "layer Qwen3" $L/$2.log | grep -v tokamax
}
run $NEW new-1
run /tmp/o/old old
run $NEW new-2
tar czf $OUT/ab/runs.tgz -C runs new-1 old new-2 2>/dev/null; tar czf $OUT/ab/logs.tgz -C $OUT/ab logs && rm -rf $L; ls $OUT/ab
