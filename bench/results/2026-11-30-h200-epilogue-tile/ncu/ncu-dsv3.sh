# Nsight Compute on DeepSeek-V3 EP8's grouped GEMMs (uniform sizes): every tile of the weight gradient, and the forward's coop tile.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$(dirname $(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)):${LD_LIBRARY_PATH:-}
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"; $NCU --version | tail -1
secs="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy"
args=('--shapes=DeepSeek-V3 EP8 rank' --sizes=uniform --tiles=all --iters=2 --warmup=1)
start=$(date +%s)
timeout 400 $NCU $secs -k regex:device_kernel --launch-skip 41 --launch-count 17 .cuda-bin/nodrop_cuda_bench "${args[@]}" > $OUT/ncu-wgrad.txt 2>&1
echo "wgrad exit $? after $(( $(date +%s) - start )) s"
timeout 150 $NCU $secs -k regex:device_kernel --launch-skip 13 --launch-count 1 .cuda-bin/nodrop_cuda_bench "${args[@]}" > $OUT/ncu-forward-coop.txt 2>&1
echo "forward exit $? after $(( $(date +%s) - start )) s"
grep -c "device_kernel" $OUT/ncu-wgrad.txt
grep -E "Duration|Compute \(SM\) Throughput|L2 Cache Throughput|DRAM Throughput|Memory Throughput|Warp Cycles Per Issued|  device_kernel|Grid Size|Cluster" $OUT/ncu-wgrad.txt | head -120
