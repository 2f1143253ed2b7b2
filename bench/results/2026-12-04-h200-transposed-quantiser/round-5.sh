# GPU round 5 (2026-12-04): round 4's profile of its fastest variant (zi) has the warps waiting
# on their global loads (long scoreboard 4.06 cycles per issued instruction) and at barriers
# (2.85): each thread block loads a tile only once it has written the last. Here 16-bit inputs
# go through shared memory by cp.async, the next tile's copies issued before the current tile
# is worked on (two 32 KiB slots a thread block, the codes written over the consumed slot; 72
# registers, three thread blocks an SM). build/gpulib/quant5.tar.xz:
#   base  main's kernel before this session (b56f766), with this tree's benchmark
#   zic   33dc926's kernel (round 4's zi as committed)
#   st4   zic with the cp.async slots, 4 tiles a thread block; st8: 8 tiles
# In turns, three times; the quantiser tests on zic, st4, st8 and the FP8 GPU tests on st4's
# nodrop_cuda_tests; memcheck and racecheck on the three; the stall reasons of st4.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/q/logs /tmp/v
L=$OUT/q/logs
exec > >(tee -a $OUT/q/round.log) 2>&1
pack() { tar czf $OUT/q.tgz -C $OUT q/logs q/round.log 2>/dev/null; }
tar xJf build/gpulib/quant5.tar.xz -C /tmp/v
S=mixtral,qwen3,dsv3,dsv3-down,mixtral-gate-up,mixtral-down
V="base zic st4 st8"
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
for v in zic st4 st8; do
  timeout 60 /tmp/v/$v/nodrop_cuda_moe_tests --gtest_filter='*QuantizeFp8*' > $L/tests-$v.log 2>&1
  el "quantiser tests $v rc=$?"; tail -1 $L/tests-$v.log
done
timeout 200 /tmp/v/st4/nodrop_cuda_tests --gtest_filter='*Fp8*' > $L/cuda-tests-fp8-st4.log 2>&1
el "cuda tests *Fp8* st4 rc=$?"; tail -1 $L/cuda-tests-fp8-st4.log
pack
for v in zic st4 st8; do for tool in memcheck racecheck synccheck; do
  timeout 120 compute-sanitizer --tool $tool --print-limit 5 /tmp/v/$v/nodrop_cuda_moe_tests \
    --gtest_filter='*QuantizeFp8*' > $L/$tool-$v.log 2>&1
  el "$tool $v rc=$?"; tail -2 $L/$tool-$v.log
done; done
pack
timeout 120 ncu --kernel-name regex:quantize_fp8_transposed --launch-count 1 \
  --section WarpStateStats --section SchedulerStats --section SpeedOfLight --section InstructionStats \
  --section Occupancy --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio \
  --page raw /tmp/v/st4/nodrop_cuda_fp8_bench --mode=training --iters=1 --warmup=0 --shapes=dsv3 \
  > $L/ncu-stalls-st4.txt 2>&1
el "ncu stalls st4 rc=$?"
grep -E "gpu__time_duration.sum|dram__throughput.avg.pct|smsp__issue_active.avg.pct|inst_executed.sum |achieved_occupancy|stalled_.*ratio" $L/ncu-stalls-st4.txt | awk '$NF+0 > 0.05 || /duration|dram|issue_active|inst_executed|occupancy/' | head -40
pack
el done
