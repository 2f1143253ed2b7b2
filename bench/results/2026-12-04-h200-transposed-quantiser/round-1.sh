# GPU round 1 (2026-12-04): the weight gradient's transposed FP8 quantiser with the next tile's
# loads issued before the current tile is reduced and written. Binaries built on the development
# machine (nvcc 13.0, sm_90a, stripped), carried as build/gpulib/quant.tar.xz, one folder each:
#   base  main's kernel (b56f766), with this tree's benchmark (its float32-input columns)
#   p2t4  prefetch, 2 thread blocks an SM for 16-bit inputs (1 for float32), 4 tiles a block
#   p3t4  prefetch, 3 an SM for 16-bit (2 for float32): ptxas spills 100-232 bytes a thread
#   p2t8  as p2t4 with 8 tiles a block;  p2t2  as p2t4 with 2
# The benchmarks in turns, three times; then the quantiser tests on every variant, and
# compute-sanitizer memcheck and racecheck on the three prefetch variants' quantiser tests.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/q/logs /tmp/v
L=$OUT/q/logs
exec > >(tee -a $OUT/q/round.log) 2>&1
pack() { tar czf $OUT/q.tgz -C $OUT q/logs q/round.log 2>/dev/null; }
tar xJf build/gpulib/quant.tar.xz -C /tmp/v
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv
S=mixtral,qwen3,dsv3,dsv3-down,mixtral-gate-up,mixtral-down
V="base p2t4 p3t4 p2t8 p2t2"
for turn in 1 2 3; do
  for v in $V; do
    timeout 90 /tmp/v/$v/nodrop_cuda_fp8_bench --mode=training --iters=50 --shapes=$S \
      > $L/training-$v-$turn.md 2>&1
    el "training $v turn $turn rc=$?"
  done
  pack
done
for turn in 1 2 3; do for v in $V; do
  echo "$v turn $turn"; grep -h -A8 "^| shape | rows" $L/training-$v-$turn.md | grep "^| [a-z]"
done; done
for v in $V; do
  timeout 60 /tmp/v/$v/nodrop_cuda_moe_tests --gtest_filter='*QuantizeFp8*' > $L/tests-$v.log 2>&1
  el "quantiser tests $v rc=$?"; tail -1 $L/tests-$v.log
done
pack
for v in p2t4 p3t4 p2t8; do for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool $tool --print-limit 5 /tmp/v/$v/nodrop_cuda_moe_tests \
    --gtest_filter='*QuantizeFp8*' > $L/$tool-$v.log 2>&1
  el "$tool $v rc=$?"; tail -2 $L/$tool-$v.log
done; pack; done
el done
