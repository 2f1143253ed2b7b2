# GPU round 9 (2026-12-04): the transposed quantiser with two row blocks a thread block, as it
# will be committed (round 8's rb2 with its codes in static shared memory), against 33dc926's.
# build/gpulib/final.tar.xz: final/ (this tree's nodrop_cuda_fp8_bench, nodrop_cuda_moe_tests,
# nodrop_cuda_tests, libnodrop_ffi_{cuda,cpu}.so), zic/ (33dc926's benchmark), lib/ (oneDNN and
# OpenCL loaders for the CPU library). In turns, three times; both GoogleTest binaries in full;
# memcheck, racecheck and synccheck on the quantiser tests; the JAX GPU suite's FP8 tests.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/q/logs /tmp/v
L=$OUT/q/logs
exec > >(tee -a $OUT/q/round.log) 2>&1
pack() { tar czf $OUT/q.tgz -C $OUT q/logs q/round.log 2>/dev/null; }
tar xJf build/gpulib/final.tar.xz -C /tmp/v
S=mixtral,qwen3,dsv3,dsv3-down,mixtral-gate-up,mixtral-down
V="zic final"
for turn in 1 2 3; do
  for v in $V; do
    timeout 90 /tmp/v/$v/nodrop_cuda_fp8_bench --mode=training --iters=50 --shapes=$S \
      > $L/training-$v-$turn.md 2>&1
    el "training $v turn $turn rc=$?"
  done
done
pack
for turn in 1 2 3; do for v in $V; do
  echo "$v turn $turn"; grep -h -A8 "^| shape | rows" $L/training-$v-$turn.md | grep "^| [a-z]"
done; done
for t in nodrop_cuda_moe_tests nodrop_cuda_tests; do
  timeout 100 /tmp/v/final/$t --gtest_brief=1 > $L/$t.log 2>&1
  el "$t rc=$?"; tail -1 $L/$t.log
done
for tool in memcheck racecheck synccheck; do
  timeout 100 compute-sanitizer --tool $tool --print-limit 5 /tmp/v/final/nodrop_cuda_moe_tests \
    --gtest_filter='*QuantizeFp8*' > $L/$tool.log 2>&1
  el "$tool rc=$?"; tail -2 $L/$tool.log
done
pack
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=/tmp/v/lib
cp /tmp/v/final/libnodrop_ffi_cuda.so /tmp/v/final/libnodrop_ffi_cpu.so nodrop/
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rfs -k fp8 tests/python/test_gpu.py > $L/pytest-gpu-fp8.log 2>&1
el "pytest test_gpu.py -k fp8 rc=$?"; tail -3 $L/pytest-gpu-fp8.log
pack
el done
