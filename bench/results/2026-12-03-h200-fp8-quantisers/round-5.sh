# GPU round 5 (2026-12-03): how many 128-column tiles a thread block of the transposed quantiser
# should take (kTilesPerThreadBlock in fp8.cu: 4 at 1b29fd2; 1 and 2 built from the same tree
# with only that constant changed, carried as build/gpulib/t1 and t2), each shape in its own
# process.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/r5/logs
L=$OUT/r5/logs
exec > >(tee -a $OUT/r5/round.log) 2>&1
B=build/gpulib
for s in mixtral qwen3 dsv3 dsv3-down mixtral-gate-up mixtral-down; do
  for v in t4 t1 t2; do
    bin=$B/nodrop_cuda_fp8_bench; [ $v != t4 ] && bin=$B/$v/nodrop_cuda_fp8_bench
    timeout 40 $bin --mode=training --iters=30 --shapes=$s > $L/training-$v-$s.md 2>&1; el "$v $s rc=$?"
  done
done
for v in t4 t1 t2; do echo "tiles per thread block: $v"; grep -h "^| [a-z]" $L/training-$v-*.md | awk -F'|' 'NF<12' | sort; done

tar czf $OUT/r5/logs.tgz -C $OUT/r5 logs && rm -rf $L; ls $OUT/r5
