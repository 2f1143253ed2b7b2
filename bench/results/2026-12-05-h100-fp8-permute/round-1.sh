# GPU round 1 (2026-12-05): permute_fp8, the permutation that writes each token's FP8 codes and
# 1x128 scales as it writes its k rows (issue 18, "quantisation fused into permute"). Binaries
# built on the development machine from 83d940f (nvcc 13.0, sm_90a, stripped) and carried as
# build/gpulib/r1.tar.xz (engine libraries, GoogleTest programs, the permute benchmark, the
# oneDNN, OpenCL and OpenMP libraries they load).
# 1. The engine's GPU tests (all of nodrop_cuda_moe_tests; the new ones bitwise the CPU engine),
#    compute-sanitizer memcheck and racecheck on the new kernel's tests.
# 2. nodrop_cuda_permute_bench: permute_rows then quantize_fp8 against permute_rows_fp8.
# 3. pytest: the GPU suite's FP8 and permute tests, XLA command buffers on.
# 4. nodrop compare: mixtral dropless in bf16 and FP8 blockwise (FP8 weight gradients), 120 steps.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r/logs /tmp/v
L=$OUT/r/logs
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz -C $OUT r/logs r/round.log 2>/dev/null
         tar czf $OUT/compare.tgz --exclude='*tfevents*' --exclude='tokenizer*' -C runs compare 2>/dev/null; }
tar xJf build/gpulib/r1.tar.xz -C /tmp/v
nvidia-smi -L
export LD_LIBRARY_PATH=/tmp/v/lib
timeout 150 /tmp/v/nodrop_cuda_moe_tests --gtest_brief=1 > $L/moe-tests.log 2>&1; el "nodrop_cuda_moe_tests rc=$?"; tail -4 $L/moe-tests.log
F='*PermuteRowsFp8*'
for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 /tmp/v/nodrop_cuda_moe_tests --gtest_brief=1 \
    --gtest_filter="$F" > $L/$tool.log 2>&1; el "$tool $F rc=$?"; tail -3 $L/$tool.log
done
timeout 90 /tmp/v/nodrop_cuda_permute_bench > $L/permute-bench.md 2>&1; el "permute bench rc=$?"; cat $L/permute-bench.md
pack
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1
cp /tmp/v/libnodrop_ffi_cuda.so /tmp/v/libnodrop_ffi_cpu.so nodrop/
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rfs tests/python/test_gpu.py -k "fp8 or permute" > $L/pytest-gpu.log 2>&1
el "pytest test_gpu.py -k 'fp8 or permute' rc=$?"; tail -4 $L/pytest-gpu.log
pack
timeout $(left 585) python3 -m nodrop compare --preset mixtral --steps 120 --seeds 0 --fp8-recipes blockwise \
  --fp8-weight-gradients fp8 --capacity-factors --eval-every 20 --eval-batches 2 --checkpoint-every 0 \
  --no-progress --out runs/compare > $L/compare.log 2>&1; el "compare rc=$?"; grep "^| " runs/compare/compare.md 2>/dev/null
pack
el done
