#!/usr/bin/env bash
# One device call: A/B of the 128x64 epilogue subtile on forward/input-gradient cooperative GEMMs
# (main vs variant, nodrop_cuda_bench in turns A B B A), then the full round (scripts/gpu-check.sh)
# on whichever library the rule in decide.py picks.
set -u
start=$(date +%s); t() { echo "[$(( $(date +%s) - start )) s] $*"; }
mkdir -p /tmp/b && tar -xJf build/gpubin/bins.tar.xz -C /tmp/b; t "untarred"
cublas=$(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$(dirname "$cublas"):${LD_LIBRARY_PATH:-}
mkdir -p $OUT/probe; nvidia-smi -L > $OUT/probe/gpu.txt
i=0
for v in main variant variant main main variant; do
  i=$((i+1))
  timeout 60 /tmp/b/$v/nodrop_cuda_bench '--shapes=DeepSeek-V3 EP8 rank,Mixtral-8x7B' '--sizes=uniform,zipf(1)' \
    --iters=100 --warmup=20 > $OUT/probe/$i-$v.md 2> $OUT/probe/$i-$v.err; t "bench $i $v exit $?"
done
python3 build/gpubin/decide.py $OUT/probe | tee $OUT/probe/decision.txt
choice=$(tail -1 $OUT/probe/decision.txt)
t "round on $choice"
timeout $(( 590 - ($(date +%s) - start) )) bash scripts/gpu-check.sh $OUT/round /tmp/b/$choice > $OUT/gpu-check.out 2>&1
echo "gpu-check exit $? after $(( $(date +%s) - start )) s" >> $OUT/gpu-check.out
tail -45 $OUT/gpu-check.out
