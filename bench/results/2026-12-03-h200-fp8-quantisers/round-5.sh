# GPU round 5 (2026-12-03, tree 4d2810e): how many 128-column tiles a thread block of the
# transposed quantiser should take (kTilesPerThreadBlock in fp8.cu: 4 in the tree; 1 built from
# the same tree with only that constant changed, carried as build/gpulib/t1), each shape in its
# own process; the tensorwise recipe on the FP8 kernels through JAX (tests, and the mixtral
# preset against bf16 and blockwise).
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r5/logs
L=$OUT/r5/logs
exec > >(tee -a $OUT/r5/round.log) 2>&1
B=build/gpulib
for s in mixtral qwen3 dsv3 dsv3-down mixtral-gate-up mixtral-down; do
  for v in t4 t1; do
    bin=$B/nodrop_cuda_fp8_bench; [ $v != t4 ] && bin=$B/$v/nodrop_cuda_fp8_bench
    timeout 40 $bin --mode=training --iters=30 --shapes=$s > $L/training-$v-$s.md 2>&1; el "$v $s rc=$?"
  done
done
for v in t4 t1; do echo "tiles per thread block: $v"; grep -h "^| [a-z]" $L/training-$v-*.md | awk -F'|' 'NF<12' | sort; done
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1
cp $B/libnodrop_ffi_cuda.so nodrop/
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu.py -k "fp8" 2>&1 | tail -4; el "pytest test_gpu fp8 rc=${PIPESTATUS[0]}"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/python/test_fp8.py -k "kernel or tensorwise" 2>&1 | tail -4; el "pytest test_fp8 kernel/tensorwise on the GPU rc=${PIPESTATUS[0]}"
timeout $(left 585) python3 -m nodrop compare --preset mixtral --steps 120 --seeds 0 --fp8-recipes blockwise tensorwise \
  --capacity-factors --eval-every 20 --eval-batches 2 --checkpoint-every 0 \
  --out runs/compare > $L/compare.log 2>&1; el "compare rc=$?"; grep -v "^\s*$" $L/compare.log | tail -12
tar czf $OUT/r5/compare.tgz -C runs compare 2>/dev/null; tar czf $OUT/r5/logs.tgz -C $OUT/r5 logs && rm -rf $L; ls $OUT/r5
