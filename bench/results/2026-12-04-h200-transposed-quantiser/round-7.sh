# GPU round 7 (2026-12-04): diagnostics of the kept kernel (33dc926, `zic`), to tell reads from
# writes. Each variant is wrong on purpose and only timed (round-7-diagnostics.patch, one
# EXP_DIAG value each; build/gpulib/diag.tar.xz):
#   d1  no codes written (the scales still are; the codes computed and kept alive)
#   d2  the codes written block-major, q_t + (b * C + column) * 128: a thread block's tile is
#       16 KiB in one piece, where q_t's layout puts its 128 columns P bytes apart
#   d3  no rows read (the chunks zeroed): the writes and the arithmetic alone
# The benchmark still counts the bytes of the real layout, so compare times (1 / GB/s).
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/q/logs /tmp/v
L=$OUT/q/logs
exec > >(tee -a $OUT/q/round.log) 2>&1
pack() { tar czf $OUT/q.tgz -C $OUT q/logs q/round.log 2>/dev/null; }
tar xJf build/gpulib/diag.tar.xz -C /tmp/v
S=mixtral,qwen3,dsv3,dsv3-down,mixtral-gate-up,mixtral-down
V="zic d1 d2 d3"
for turn in 1 2; do
  for v in $V; do
    timeout 90 /tmp/v/$v/nodrop_cuda_fp8_bench --mode=training --iters=50 --shapes=$S \
      > $L/training-$v-$turn.md 2>&1
    el "training $v turn $turn rc=$?"
  done
  pack
done
for turn in 1 2; do for v in $V; do
  echo "$v turn $turn"; grep -h -A8 "^| shape | rows" $L/training-$v-$turn.md | grep "^| [a-z]"
done; done
el done
