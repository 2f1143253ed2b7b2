cp .cuda-bin/libnodrop_ffi_cuda.so nodrop/
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$(dirname $(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)):${LD_LIBRARY_PATH:-}
export PYTHONPATH=$PWD:$PWD/bench
for flags in "" "--xla_gpu_enable_command_buffer=" "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT" ""; do
  XLA_FLAGS="$flags" timeout 120 python3 .cuda-bin/layer_flags.py 2>&1 | grep -v Warning | tee -a $OUT/layer-flags.log
done
