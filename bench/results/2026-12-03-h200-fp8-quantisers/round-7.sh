# GPU round 7 (2026-12-03): the transposed quantiser with 8 and 16 tiles per thread block
# (kTilesPerThreadBlock; 4 in the tree, round 5 measured 1 slower than 4), built from the tree of
# round 5 with only that constant changed (build/gpulib/t8, t16), each shape in its own process.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/r7/logs
L=$OUT/r7/logs
exec > >(tee -a $OUT/r7/round.log) 2>&1
B=build/gpulib
for s in mixtral qwen3 dsv3 dsv3-down mixtral-gate-up mixtral-down; do
  for v in t4 t8 t16; do
    bin=$B/nodrop_cuda_fp8_bench; [ $v != t4 ] && bin=$B/$v/nodrop_cuda_fp8_bench
    timeout 40 $bin --mode=training --iters=30 --shapes=$s > $L/training-$v-$s.md 2>&1; el "$v $s rc=$?"
  done
done
for v in t4 t8 t16; do echo "tiles per thread block: $v"; grep -h "^| [a-z]" $L/training-$v-*.md | awk -F'|' 'NF<12' | sort; done
tar czf $OUT/r7/logs.tgz -C $OUT/r7 logs && rm -rf $L; ls $OUT/r7
