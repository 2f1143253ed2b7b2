# GPU round 8 (2026-12-04): round 7 put the transposed quantiser's gap on its writes (the codes
# written block-major ran at 0.82-0.93 of a copy against 0.72-0.85). q_t's layout is the weight
# gradient's (engine.h), but a column's codes of consecutive row blocks are neighbours in it, so
# here a thread block takes one column tile of kRowBlocks consecutive row blocks and writes each
# column's kRowBlocks * 128 bytes in one piece (one tile a thread block; the codes in dynamic
# shared memory, 16 KiB a row block). build/gpulib/rb.tar.xz:
#   zic  33dc926's kernel;  rb2, rb4: kRowBlocks 2 and 4
# In turns, three times; the quantiser tests; memcheck, racecheck and synccheck on both.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/q/logs /tmp/v
L=$OUT/q/logs
exec > >(tee -a $OUT/q/round.log) 2>&1
pack() { tar czf $OUT/q.tgz -C $OUT q/logs q/round.log 2>/dev/null; }
tar xJf build/gpulib/rb.tar.xz -C /tmp/v
S=mixtral,qwen3,dsv3,dsv3-down,mixtral-gate-up,mixtral-down
V="zic rb2 rb4"
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
for v in rb2 rb4; do
  timeout 60 /tmp/v/$v/nodrop_cuda_moe_tests --gtest_filter='*QuantizeFp8*' > $L/tests-$v.log 2>&1
  el "quantiser tests $v rc=$?"; tail -1 $L/tests-$v.log
  for tool in memcheck racecheck synccheck; do
    timeout 120 compute-sanitizer --tool $tool --print-limit 5 /tmp/v/$v/nodrop_cuda_moe_tests \
      --gtest_filter='*QuantizeFp8*' > $L/$tool-$v.log 2>&1
    el "$tool $v rc=$?"; tail -2 $L/$tool-$v.log
  done
  pack
done
el done
