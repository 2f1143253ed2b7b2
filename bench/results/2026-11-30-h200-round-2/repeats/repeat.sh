# gpu_moe.py twice more for the shapes near 1.0 (Mixtral, DeepSeek-V3 EP8; Mixtral's layer).
cp .cuda-bin/libnodrop_ffi_cuda.so nodrop/
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$(dirname $(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)):${LD_LIBRARY_PATH:-}
export PYTHONPATH=$PWD:$PWD/bench
nvidia-smi -L > $OUT/gpu.txt
for run in 1 2; do
  timeout 260 python3 bench/gpu_moe.py --out $OUT/repeat-$run --shapes Mixtral-8x7B,DeepSeek-V3-EP8 > $OUT/repeat-$run.log 2>&1
  echo "run $run exit $?"
  grep -A40 "## Targets" $OUT/repeat-$run/gpu-moe.md | grep "torch\|layer"
done
