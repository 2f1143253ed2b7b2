# GPU round 4 (2026-12-04): which kernels cuBLAS runs for the strided batched GEMM (the capacity
# layer's) where it beats nodrop's grouped kernel, read from Nsight Compute's kernel names (tile,
# cluster, schedule), one shape per ncu run, equal groups, 3 timed calls after 1. Durations
# under ncu are for telling the kernels apart, not for comparing speed.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/rf/logs /tmp/rf
L=$OUT/rf/logs
exec > >(tee -a $OUT/rf/round.log) 2>&1
pack() { tar czf $OUT/rf/logs-4.tgz -C $OUT/rf logs; }
tar xJf build/gpulib/rows-form.tar.xz -C /tmp/rf; B=/tmp/rf/nodrop_cuda_bench
cublas=$(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=${cublas:+$(dirname "$cublas"):}${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,uuid --format=csv
i=0
for shape in Qwen3-30B-A3B DeepSeek-V2-Lite "DeepSeek-V3 EP8 rank" "DeepSeek-V2-Lite 1k tokens" "mixtral preset down"; do
  i=$((i + 1))
  timeout 90 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    $B --shapes="$shape" --sizes=uniform --iters=3 --warmup=1 > $L/ncu-$i.csv 2> $L/ncu-$i.err
  el "$shape rc=$?"; pack
  python3 - "$L/ncu-$i.csv" <<'PY'
import csv, sys, collections
names = collections.OrderedDict()
with open(sys.argv[1]) as f:
    rows = [r for r in csv.reader(f) if len(r) > 10]
head = rows[0]; k = head.index("Kernel Name")
for r in rows[1:]:
    names[r[k][:160]] = names.get(r[k][:160], 0) + 1
for n, c in names.items():
    print(f"  {c:3d}x {n}")
PY
done
rm -rf $L; ls $OUT/rf
