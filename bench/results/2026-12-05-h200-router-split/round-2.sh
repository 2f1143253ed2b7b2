# GPU round 2 (2026-12-05): the tree with router_matmul="split" as the default and the FP8
# epilogue's 128x64 subtile, built on the development machine (nvcc 13.0, sm_90a, stripped) and
# carried as build/gpulib/r2.tar.xz (engine libraries, nodrop_cuda_tests, the oneDNN and OpenCL
# loaders): issue 19's step target (`nodrop compare`, dropless against capacity 1.0, the mixtral,
# qwen3 and deepseek presets, as 2026-12-03-h200-step-compare), the JAX GPU suite in full with
# CUDA graphs on, and racecheck of the FP8 kernels on short cases.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r/logs /tmp/v
L=$OUT/r/logs
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz -C $OUT r/logs r/round.log 2>/dev/null
         tar czf $OUT/compare.tgz --exclude='*tfevents*' --exclude='tokenizer*' -C runs compare-mixtral compare-qwen3 compare-deepseek 2>/dev/null; }
tar xJf build/gpulib/r2.tar.xz -C /tmp/v
nvidia-smi -L
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=/tmp/v/lib
cp /tmp/v/libnodrop_ffi_cuda.so /tmp/v/libnodrop_ffi_cpu.so nodrop/
for preset in mixtral qwen3 deepseek; do
  budget=$([ $preset = mixtral ] && echo 110 || ([ $preset = qwen3 ] && echo 190 || echo 280))
  timeout $(left $budget) python3 -m nodrop compare --preset $preset --steps 50 --seeds 0 \
    --capacity-factors 1.0 --eval-every 50 --eval-batches 2 --checkpoint-every 0 --no-progress \
    --out runs/compare-$preset > $L/compare-$preset.log 2>&1; el "compare $preset rc=$?"
  grep "^| " runs/compare-$preset/compare.md 2>/dev/null | head -4
done
pack
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  timeout $(left 520) python3 -m pytest -q -p no:cacheprovider -rfs tests/python/test_gpu.py > $L/pytest-gpu.log 2>&1
el "pytest test_gpu.py rc=$?"; tail -4 $L/pytest-gpu.log
pack
F='*CudaFp8BlockwiseTest*mixed*:*CudaFp8ContractTest*mixed*'
timeout $(left 575) compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 3 \
  /tmp/v/nodrop_cuda_tests --gtest_brief=1 --gtest_filter="$F" > $L/racecheck.log 2>&1
el "racecheck rc=$?"; tail -3 $L/racecheck.log
pack
el done
