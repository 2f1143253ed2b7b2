exec > >(tee -a OUT/r2e.log) 2>&1
cp build/gpulib/libnodrop_ffi_cuda.so nodrop/
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 40 python3 build/round/fp8_diag2.py 2>&1 | grep -v Warning
echo "== --xla_allow_excess_precision=false"
XLA_FLAGS=--xla_allow_excess_precision=false timeout 40 python3 build/round/fp8_diag2.py 2>&1 | grep -v Warning
