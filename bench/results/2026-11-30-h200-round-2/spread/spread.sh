cp .cuda-bin/libnodrop_ffi_cuda.so nodrop/
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$(dirname $(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)):${LD_LIBRARY_PATH:-}
export PYTHONPATH=$PWD:$PWD/bench
nvidia-smi -L > $OUT/gpu.txt
for p in 1 2 3; do timeout 60 python3 .cuda-bin/spread.py $p 2>&1 | grep -v Warning | tee -a $OUT/spread.log; done
