exec > >(tee -a OUT/r2d.log) 2>&1
cp build/gpulib/libnodrop_ffi_cuda.so nodrop/
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 80 python3 build/round/fp8_diag.py 2>&1 | grep -v Warning
