# GPU round 1 (2026-12-06). Issue 18: the transposed quantiser's given-scale branch (8724935, the
# tensorwise recipe's weight-gradient operands on the engine) had only been compiled; check it,
# then time the recipes on one card. Binaries built on the development machine from the commit
# named in the README (nvcc 13.0, sm_90a, stripped) and carried as build/gpulib/r1.tar.xz (engine
# libraries, GoogleTest programs, the FP8 benchmark, the oneDNN and OpenMP libraries they load).
# 1. nodrop_cuda_moe_tests (all; QuantizeFp8TransposedGpu now covers given scales), then
#    compute-sanitizer memcheck and racecheck on the transposed quantiser's tests.
# 2. nodrop_cuda_fp8_bench --mode=training: a layer's three GEMMs in bf16 and FP8 (with the
#    quantisers), every shape, so the FP8 and the bf16 weight gradient can be compared per shape;
#    then every FP8 kernel configuration on the forwards of Qwen3's layer and on the shapes of
#    input gradients (short contractions into wide rows), which the tile rule was not chosen on.
# 3. pytest: the GPU suite's FP8 tests, XLA command buffers on.
# 4. nodrop compare: mixtral dropless in bf16 and in FP8 blockwise and tensorwise, each with the
#    FP8 and the unquantised weight gradient, 120 steps, same seed and batches.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r/logs /tmp/v
L=$OUT/r/logs
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz -C $OUT r/logs r/round.log 2>/dev/null
         tar czf $OUT/compare.tgz --exclude='*tfevents*' --exclude='tokenizer*' -C runs compare 2>/dev/null; }
tar xJf build/gpulib/r1.tar.xz -C /tmp/v
nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
export LD_LIBRARY_PATH=/tmp/v/lib
timeout 150 /tmp/v/nodrop_cuda_moe_tests --gtest_brief=1 > $L/moe-tests.log 2>&1; el "nodrop_cuda_moe_tests rc=$?"; tail -4 $L/moe-tests.log
F='*QuantizeFp8Transposed*'
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 /tmp/v/nodrop_cuda_moe_tests --gtest_brief=1 \
    --gtest_filter="$F" > $L/$tool.log 2>&1; el "$tool $F rc=$?"; tail -3 $L/$tool.log
done
pack
timeout 120 /tmp/v/nodrop_cuda_fp8_bench --mode=training > $L/fp8-training-bench.md 2>&1; el "fp8 bench rc=$?"
cat $L/fp8-training-bench.md
timeout 120 /tmp/v/nodrop_cuda_fp8_bench --configs=all \
  --shapes=qwen3,qwen3-gate-up,qwen3-down,dsv3-down,mixtral-down \
  > $L/fp8-forward-configs.md 2>&1; el "fp8 bench configs=all rc=$?"; tail -12 $L/fp8-forward-configs.md
pack
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1
cp /tmp/v/libnodrop_ffi_cuda.so /tmp/v/libnodrop_ffi_cpu.so nodrop/
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rfs tests/python/test_gpu.py -k "fp8" > $L/pytest-gpu.log 2>&1
el "pytest test_gpu.py -k fp8 rc=$?"; tail -4 $L/pytest-gpu.log
pack
timeout $(left 590) python3 -m nodrop compare --preset mixtral --steps 120 --seeds 0 \
  --fp8-recipes blockwise tensorwise --fp8-weight-gradients fp8 unquantised --capacity-factors \
  --eval-every 20 --eval-batches 2 --checkpoint-every 0 --no-progress --out runs/compare \
  > $L/compare.log 2>&1; el "compare rc=$?"; grep "^| " runs/compare/compare.md 2>/dev/null
pack
el done
