# GPU round 2 (2026-12-03, evening): the branch jvp-order (6e72f44, f74688d: bilinear JVPs sum
# the first operand's term last, as 849131f's custom_vjp ordered the gradients; one JVP rule for
# the grouped matmuls and row movers) against main (2dbb256), on one card, in turns (main, branch,
# main, branch), the Qwen3 and DeepSeek-V2-Lite layers. The branch's `nodrop/` and `bench/*.py`
# are carried as build/gpulib/jvp-order.tar.xz; both run on main's engine
# (build/gpulib/bundle.tar.xz), so only the order of the backward's ops can differ.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/ab/logs /tmp/b /tmp/j
L=$OUT/ab/logs
exec > >(tee -a $OUT/ab/round.log) 2>&1
[ -f /tmp/b/libnodrop_ffi_cuda.so ] || tar xJf build/gpulib/bundle.tar.xz -C /tmp/b
tar xJf build/gpulib/jvp-order.tar.xz -C /tmp/j
export NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=/tmp/b/lib
cp /tmp/b/libnodrop_ffi_cuda.so /tmp/b/libnodrop_ffi_cpu.so nodrop/
cp /tmp/b/libnodrop_ffi_cuda.so /tmp/b/libnodrop_ffi_cpu.so /tmp/j/jv/nodrop/
MAIN=$PWD
run() {  # run TREE LABEL
  (cd $1 && PYTHONPATH=$1 timeout 150 python3 bench/gpu_moe.py --only layer \
     --shapes Qwen3-30B-A3B,DeepSeek-V2-Lite --out $MAIN/runs/$2 > $L/$2.log 2>&1); el "$2 rc=$?"
  grep "layer .* router fwd+bwd" $L/$2.log | grep -v tokamax
}
run $MAIN main-1
run /tmp/j/jv branch-1
run $MAIN main-2
run /tmp/j/jv branch-2
tar czf $OUT/ab/runs.tgz -C runs main-1 branch-1 main-2 branch-2 2>/dev/null; tar czf $OUT/ab/logs.tgz -C $OUT/ab logs && rm -rf $L; ls $OUT/ab
