# GPU round 1 (2026-12-07, session 8): the tensorwise recipe's FP8 weight gradient on its rows'
# codes re-laid (transpose_codes) and kept from the forward, against the same recipe re-quantising
# lhs and dout from bfloat16 for it (quantize_transposed at their scales). The engine
# (libnodrop_ffi_cuda.so, libnodrop_ffi_cpu.so, nodrop_cuda_moe_tests, nodrop_cuda_fp8_bench)
# built on the development machine with nvcc 13.0 for sm_90a, carried as
# build/gpulib/relay.tar.xz; oneDNN's runtime as build/gpulib/deps.tar.xz. "before": the same
# package and libraries with the previous nodrop/ops/fp8.py (build/gpulib/fp8_before.py), run
# from its own folder (python -m puts the working folder first on sys.path).
#   1. the new kernel's GPU tests beside the quantisers' and compute-sanitizer on them; the JAX
#      FP8 tests on the GPU;
#   2. nodrop_cuda_fp8_bench --mode=training (the re-layout's bandwidth, the recipe's layer);
#   3. 40 training steps of mixtral in FP8 tensorwise: the FP8 weight gradient after and before,
#      the bf16 one (the default), and bf16, in turns.
set -u
BUDGET=${BUDGET:-560}
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - start) - ${1:-10} )); }
mkdir -p $OUT/r
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz --exclude='*tfevents*' --exclude='*.pb' --exclude='*trace.json.gz' \
           --exclude='tokenizer*' -C $OUT r; }
nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
tar xJf build/gpulib/deps.tar.xz -C / --skip-old-files
mkdir -p build/gpu && tar xJf build/gpulib/relay.tar.xz -C build/gpu
cp build/gpu/libnodrop_ffi_cuda.so build/gpu/libnodrop_ffi_cpu.so nodrop/
rm -rf /tmp/before && mkdir -p /tmp/before && cp -r nodrop /tmp/before/
cp build/gpulib/fp8_before.py /tmp/before/nodrop/ops/fp8.py
export PYTHONUNBUFFERED=1 NODROP_CACHE=/tmp/cache
REPO=$PWD

build/gpu/nodrop_cuda_moe_tests --gtest_brief=1 \
  --gtest_filter='*TransposeFp8Codes*:*QuantizeFp8Transposed*:*PermuteRowsFp8Gpu*' \
  > $OUT/r/moe-tests.log 2>&1
el "nodrop_cuda_moe_tests (re-layout, quantisers) rc=$?"; tail -3 $OUT/r/moe-tests.log
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --error-exitcode 9 build/gpu/nodrop_cuda_moe_tests \
    --gtest_brief=1 --gtest_filter='TransposeFp8Codes*' 2>&1 | tail -4 > $OUT/r/sanitizer-$tool.log
  el "compute-sanitizer $tool rc=${PIPESTATUS[0]}"; cat $OUT/r/sanitizer-$tool.log
done
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  PYTHONPATH=$REPO timeout 200 python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu.py \
  -k fp8 > $OUT/r/pytest-gpu-fp8.log 2>&1
el "pytest test_gpu.py -k fp8 rc=$?"; tail -2 $OUT/r/pytest-gpu-fp8.log
timeout 120 build/gpu/nodrop_cuda_fp8_bench --mode=training > $OUT/r/fp8-training-bench.md \
  2> $OUT/r/fp8-training-bench.err
el "fp8 bench rc=$?"; tail -16 $OUT/r/fp8-training-bench.md
pack

run() {  # name, folder to run from, flags...
  local name=$1 from=$2; shift 2
  [ $(left 60) -lt 0 ] && { el "no time for $name"; return; }
  (cd $from && PYTHONPATH=$from timeout $(left 15) python3 -m nodrop train --steps 40 \
    --eval-every 40 --eval-batches 1 --checkpoint-every 0 --no-progress "$@" \
    --out /tmp/runs/$name > $OUT/r/train-$name.log 2>&1)
  el "train $name rc=$?: $(grep -E 'tokens/s over' $OUT/r/train-$name.log | tail -1)"
  mkdir -p $OUT/r/runs/$name && cp /tmp/runs/$name/*.json* $OUT/r/runs/$name/ 2>/dev/null
  pack
}
run fp8-wgrad-after $REPO --preset mixtral --fp8 tensorwise --fp8-weight-gradient fp8
run fp8-wgrad-before /tmp/before --preset mixtral --fp8 tensorwise --fp8-weight-gradient fp8
run fp8-unquantised $REPO --preset mixtral --fp8 tensorwise
run bf16 $REPO --preset mixtral
run fp8-wgrad-before-2 /tmp/before --preset mixtral --fp8 tensorwise --fp8-weight-gradient fp8
run fp8-wgrad-after-2 $REPO --preset mixtral --fp8 tensorwise --fp8-weight-gradient fp8
el done
pack; rm -rf $OUT/r
