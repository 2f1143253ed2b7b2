# GPU round 1 (2026-12-05): (a) MoEConfig.router_matmul "split" (the float32 router as one bf16
# GEMM of three parts) against "float32" in the MoE layer benchmark, in turns; its GPU test.
# (b) The FP8 cooperative kernels' epilogue stored in 128x64 subtiles (ep64, the patch beside this
# script) against CUTLASS's automatic 128x32 (main), FP8 training benchmark in turns; ep64's
# GoogleTests, memcheck, and racecheck of both on the same FP8 cases.
# build/gpulib/r1.tar.xz: main/ (main at 9e371a5: libraries, tests, benchmarks), ep64/ (the
# patched build's libnodrop_ffi_cuda.so, nodrop_cuda_tests, nodrop_cuda_fp8_bench), lib/ (oneDNN
# and OpenCL loaders for the CPU library); nvcc 13.0, sm_90a, stripped.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r/logs /tmp/v
L=$OUT/r/logs
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz -C $OUT r/logs r/round.log r/runs 2>/dev/null; }
tar xJf build/gpulib/r1.tar.xz -C /tmp/v
nvidia-smi -L
S=mixtral,qwen3,dsv3,dsv3-down,mixtral-gate-up,mixtral-down
for turn in 1 2 3; do for v in main ep64; do
  timeout 60 /tmp/v/$v/nodrop_cuda_fp8_bench --mode=training --iters=50 --shapes=$S \
    > $L/training-$v-$turn.md 2>&1; el "fp8 training $v turn $turn rc=$?"
done; done
for turn in 1 2 3; do for v in main ep64; do
  echo "$v turn $turn"; grep -h -A8 "^| shape | rows" $L/training-$v-$turn.md | grep "^| [a-z]"
done; done
timeout 60 /tmp/v/ep64/nodrop_cuda_tests --gtest_brief=1 > $L/ep64-nodrop_cuda_tests.log 2>&1
el "ep64 nodrop_cuda_tests rc=$?"; tail -1 $L/ep64-nodrop_cuda_tests.log
F='*CudaFp8BlockwiseTest*mixed*:*CudaFp8BlockwiseTest*long_k*:*CudaFp8ContractTest*mixed*:*CudaFp8ContractTest*one_group*:CudaFp8*Graph.*'
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 5 /tmp/v/ep64/nodrop_cuda_tests \
  --gtest_brief=1 --gtest_filter="$F" > $L/ep64-memcheck.log 2>&1; el "ep64 memcheck rc=$?"; tail -2 $L/ep64-memcheck.log
for v in main ep64; do
  timeout 60 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 3 /tmp/v/$v/nodrop_cuda_tests \
    --gtest_brief=1 --gtest_filter="$F" > $L/$v-racecheck.log 2>&1; el "$v racecheck rc=$?"
  grep -c "hazard" $L/$v-racecheck.log; grep "RACECHECK SUMMARY" $L/$v-racecheck.log
done
pack
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=/tmp/v/lib
cp /tmp/v/main/libnodrop_ffi_cuda.so /tmp/v/main/libnodrop_ffi_cpu.so nodrop/
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  timeout 90 python3 -m pytest -q -p no:cacheprovider -rfs -k router tests/python/test_gpu.py > $L/pytest-gpu-router.log 2>&1
el "pytest test_gpu.py -k router rc=$?"; tail -3 $L/pytest-gpu-router.log
mkdir -p $OUT/r/runs
layer() {  # layer ROUTER SHAPES LABEL
  timeout $(left $4) python3 bench/gpu_moe.py --only layer --router-matmul $1 --shapes $2 \
    --out $OUT/r/runs/$3 > $L/$3.log 2>&1; el "$3 rc=$?"
  grep "layer .* router fwd" $L/$3.log | grep -v tokamax
}
layer float32 Mixtral-8x7B,Qwen3-30B-A3B,DeepSeek-V2-Lite f32-1 330
layer split Mixtral-8x7B,Qwen3-30B-A3B,DeepSeek-V2-Lite split-1 430
layer float32 Qwen3-30B-A3B,DeepSeek-V2-Lite f32-2 500
layer split Qwen3-30B-A3B,DeepSeek-V2-Lite split-2 570
pack
el done
