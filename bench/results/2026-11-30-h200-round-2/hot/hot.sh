# gpu_moe.py with the heat-up phase, for the shapes near 1.0 (Mixtral, DeepSeek-V3 EP8; Mixtral's layer).
cp .cuda-bin/libnodrop_ffi_cuda.so nodrop/
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$(dirname $(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)):${LD_LIBRARY_PATH:-}
export PYTHONPATH=$PWD:$PWD/bench
nvidia-smi -L > $OUT/gpu.txt
start=$(date +%s)
timeout 300 python3 bench/gpu_moe.py --out $OUT/hot --shapes Mixtral-8x7B,DeepSeek-V3-EP8 > $OUT/hot.log 2>&1
echo "exit $? after $(( $(date +%s) - start )) s"
grep -A40 "## Targets" $OUT/hot/gpu-moe.md | grep "torch\|layer\|dense\|pass"
