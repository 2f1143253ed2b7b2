# GPU round 1 (2026-12-07, session 7): gradients in the compute dtype (--compute-dtype-gradients,
# the default) against float32 gradients (--no-compute-dtype-gradients), the same libraries and
# card. The engine (libnodrop_ffi_cuda.so, libnodrop_ffi_cpu.so, nodrop_cuda_moe_tests,
# nodrop_cuda_adamw_bench) built on the development machine with nvcc 13.0 for sm_90a, carried as
# build/gpulib/grads.tar.xz; oneDNN's runtime as build/gpulib/deps.tar.xz.
#   1. the AdamW kernel's GPU tests (16-bit gradients among them) and compute-sanitizer on them;
#      the JAX op's and the trainer's tests on the GPU;
#   2. nodrop_cuda_adamw_bench (the kernel with a float32 and a bfloat16 gradient);
#   3. 40 training steps of qwen3, mixtral and deepseek with each setting, in turns, and of
#      mixtral in FP8 tensorwise;
#   4. bench/gpu_optimizer.py (the step's tail alone) if time is left.
set -u
BUDGET=${BUDGET:-570}
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - start) - ${1:-10} )); }
mkdir -p $OUT/r
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz --exclude='*tfevents*' --exclude='*.pb' --exclude='*trace.json.gz' \
           --exclude='tokenizer*' -C $OUT r; }
nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
git log -1 --format='commit %H' 2>/dev/null; git status --short | head -5
tar xJf build/gpulib/deps.tar.xz -C / --skip-old-files
mkdir -p build/gpu && tar xJf build/gpulib/grads.tar.xz -C build/gpu
cp build/gpu/libnodrop_ffi_cuda.so build/gpu/libnodrop_ffi_cpu.so nodrop/
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NODROP_CACHE=/tmp/cache

build/gpu/nodrop_cuda_moe_tests --gtest_brief=1 --gtest_filter='*AdamW*' > $OUT/r/adamw-tests.log 2>&1
el "nodrop_cuda_moe_tests '*AdamW*' rc=$?"; tail -3 $OUT/r/adamw-tests.log
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --error-exitcode 9 build/gpu/nodrop_cuda_moe_tests \
    --gtest_brief=1 --gtest_filter='*AdamWGpu*grad_*:*AdamWGpu*n1003*' 2>&1 | tail -4 \
    > $OUT/r/sanitizer-$tool.log
  el "compute-sanitizer $tool rc=${PIPESTATUS[0]}"; cat $OUT/r/sanitizer-$tool.log
done
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu.py -k adamw \
  tests/python/test_adamw.py > $OUT/r/pytest-adamw.log 2>&1
el "pytest test_gpu.py -k adamw, test_adamw.py rc=$?"; tail -2 $OUT/r/pytest-adamw.log
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/python/test_train.py -k compute_dtype \
  > $OUT/r/pytest-train.log 2>&1
el "pytest test_train.py -k compute_dtype rc=$?"; tail -2 $OUT/r/pytest-train.log
build/gpu/nodrop_cuda_adamw_bench > $OUT/r/adamw-bench.md 2>&1
el "adamw bench rc=$?"; cat $OUT/r/adamw-bench.md
pack

run() {  # name, flags...
  local name=$1; shift
  [ $(left 60) -lt 0 ] && { el "no time for $name"; return; }
  timeout $(left 15) python3 -m nodrop train --steps 40 --eval-every 40 --eval-batches 1 \
    --checkpoint-every 0 --no-progress "$@" --out /tmp/runs/$name > $OUT/r/train-$name.log 2>&1
  el "train $name rc=$?: $(grep -E 'tokens/s over' $OUT/r/train-$name.log | tail -1)"
  mkdir -p $OUT/r/runs/$name && cp /tmp/runs/$name/*.json* $OUT/r/runs/$name/ 2>/dev/null
  pack
}
run qwen3-on --preset qwen3 --compute-dtype-gradients
run qwen3-off --preset qwen3 --no-compute-dtype-gradients
run mixtral-off --preset mixtral --no-compute-dtype-gradients
run mixtral-on --preset mixtral --compute-dtype-gradients
run deepseek-on --preset deepseek --compute-dtype-gradients
run deepseek-off --preset deepseek --no-compute-dtype-gradients
run mixtral-fp8-on --preset mixtral --fp8 tensorwise --compute-dtype-gradients
run mixtral-fp8-off --preset mixtral --fp8 tensorwise --no-compute-dtype-gradients

if [ $(left 100) -gt 0 ]; then
  timeout $(left 5) python3 bench/gpu_optimizer.py qwen3 mixtral --out $OUT/r/optimizer \
    --iters 10 > $OUT/r/optimizer.log 2>&1
  el "optimizer bench rc=$?"; cat $OUT/r/optimizer/optimizer.md 2>/dev/null || tail -5 $OUT/r/optimizer.log
fi
el done
pack; rm -rf $OUT/r
