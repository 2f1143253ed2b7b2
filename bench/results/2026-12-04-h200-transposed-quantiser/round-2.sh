# GPU round 2 (2026-12-04): the transposed FP8 quantiser's grid in the other order. Round 1's
# prefetch variants were all slower than main's kernel, and the kernel reads each row of x in
# 256-byte pieces (one tile's 128 columns) while the neighbouring thread blocks read other rows;
# from float32 inputs (512-byte pieces) it ran at 0.85-0.98 of a copy. Here the grid is 1-D with
# a row block's tile groups side by side (thread block b * tile_groups + y), so the thread blocks
# running together read neighbouring tiles of the same rows. build/gpulib/quant2.tar.xz:
#   base  main's kernel (b56f766), with this tree's benchmark (as round 1's base)
#   swN   the grid in the other order, N tiles a thread block (N = 4 is main's count)
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/q/logs /tmp/v
L=$OUT/q/logs
exec > >(tee -a $OUT/q/round.log) 2>&1
pack() { tar czf $OUT/q.tgz -C $OUT q/logs q/round.log 2>/dev/null; }
tar xJf build/gpulib/quant2.tar.xz -C /tmp/v
S=mixtral,qwen3,dsv3,dsv3-down,mixtral-gate-up,mixtral-down
V="base sw4 sw2 sw1 sw8"
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
for v in sw4 sw1; do for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool $tool --print-limit 5 /tmp/v/$v/nodrop_cuda_moe_tests \
    --gtest_filter='*QuantizeFp8*' > $L/$tool-$v.log 2>&1
  el "$tool $v rc=$?"; tail -2 $L/$tool-$v.log
done; pack; done
el done
