# GPU round 3 (2026-12-04): Nsight Compute on main's transposed FP8 quantiser (round 2's `base`
# binary, build/gpulib/quant2.tar.xz), neither of rounds 1-2's changes having helped: the first
# two launches (the activations', then the output gradient's, in the benchmark's set-up) at
# DeepSeek-V3's rank shape and at Mixtral's, --set full; and the rows quantiser at DeepSeek-V3's,
# which runs at a copy's bandwidth, for comparison.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/q/logs /tmp/v
L=$OUT/q/logs
exec > >(tee -a $OUT/q/round.log) 2>&1
pack() { tar czf $OUT/q.tgz -C $OUT q/logs q/round.log 2>/dev/null; }
tar xJf build/gpulib/quant2.tar.xz -C /tmp/v
B=/tmp/v/base/nodrop_cuda_fp8_bench
for s in dsv3 mixtral; do
  timeout 240 ncu --kernel-name regex:quantize_fp8_transposed --launch-count 2 --set full \
    -o $L/ncu-transposed-$s $B --mode=training --iters=1 --warmup=0 --shapes=$s > $L/ncu-run-$s.log 2>&1
  el "ncu transposed $s rc=$?"
  ncu --import $L/ncu-transposed-$s.ncu-rep --page details > $L/ncu-transposed-$s.txt 2>&1
  pack
done
timeout 120 ncu --kernel-name regex:quantize_fp8_rows --launch-count 1 --set full \
  -o $L/ncu-rows-dsv3 $B --mode=training --iters=1 --warmup=0 --shapes=dsv3 > $L/ncu-run-rows.log 2>&1
el "ncu rows rc=$?"
ncu --import $L/ncu-rows-dsv3.ncu-rep --page details > $L/ncu-rows-dsv3.txt 2>&1
pack
for f in $L/ncu-transposed-dsv3.txt $L/ncu-rows-dsv3.txt; do
  grep -E "quantize_fp8|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Stall|One or More Eligible|Block Limit" $f | head -60
done
el done
