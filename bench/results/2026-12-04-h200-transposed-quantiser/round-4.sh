# GPU round 4 (2026-12-04): round 3's profile (Nsight Compute at DeepSeek-V3's rank shape) found
# main's transposed quantiser issue-bound rather than memory-bound: 48.7% issue slots busy, 2.18
# instructions a cycle, 6 warps a scheduler (3 thread blocks an SM, by registers), DRAM at 56%
# of peak; 3.2-way bank conflicts on shared loads; and a third of its thread blocks, those past
# the groups (fp8_contract_blocks(M, G) bounds the count), running the whole tile pipeline to
# write scale 1 and zero codes. build/gpulib/quant3.tar.xz:
#   base  main's kernel (b56f766), with this tree's benchmark
#   z     thread blocks without rows write scale 1 and zero codes directly (bitwise the same)
#   i     the column inverses stored column-group-major: the 8 reads per tile conflict-free
#   zi    both
# In turns, three times; the quantiser tests on each; memcheck and racecheck on zi's; the stall
# reasons of base and zi at DeepSeek-V3's rank shape.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/q/logs /tmp/v
L=$OUT/q/logs
exec > >(tee -a $OUT/q/round.log) 2>&1
pack() { tar czf $OUT/q.tgz -C $OUT q/logs q/round.log 2>/dev/null; }
tar xJf build/gpulib/quant3.tar.xz -C /tmp/v
S=mixtral,qwen3,dsv3,dsv3-down,mixtral-gate-up,mixtral-down
V="base z i zi"
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
for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool $tool --print-limit 5 /tmp/v/zi/nodrop_cuda_moe_tests \
    --gtest_filter='*QuantizeFp8*' > $L/$tool-zi.log 2>&1
  el "$tool zi rc=$?"; tail -2 $L/$tool-zi.log
done
pack
for v in base zi; do
  timeout 120 ncu --kernel-name regex:quantize_fp8_transposed --launch-count 1 \
    --section WarpStateStats --section SchedulerStats --section SpeedOfLight --section InstructionStats \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio \
    --page raw /tmp/v/$v/nodrop_cuda_fp8_bench --mode=training --iters=1 --warmup=0 --shapes=dsv3 \
    > $L/ncu-stalls-$v.txt 2>&1
  el "ncu stalls $v rc=$?"
  grep -E "gpu__time_duration.sum|dram__throughput.avg.pct|smsp__issue_active.avg.pct|inst_executed.sum |stalled_.*ratio" $L/ncu-stalls-$v.txt | awk '$NF+0 > 0.05 || /duration|dram|issue_active|inst_executed/' | head -40
done
pack
el done
