# GPU round 2, call B (2026-12-02): the JAX ops' GPU tests on the library call A built, then the
# mixtral preset trained dropless in bf16 and on the FP8 blockwise recipe (same seed, weights
# and batches) with nodrop compare.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
exec > >(tee -a OUT/r2b.log) 2>&1
cp build/gpulib/libnodrop_ffi_cuda.so nodrop/
export PYTHONPATH=$PWD NODROP_CACHE=runs/cache PYTHONUNBUFFERED=1
mkdir -p runs/s
[ -d runs/corpus ] || python3 bench/make_corpus.py runs/corpus 48 > runs/s/corpus.log 2>&1
el corpus
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  timeout 260 python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu.py ${PYTEST_K:+-k "$PYTEST_K"} > OUT/pytest-gpu.log 2>&1
el "pytest test_gpu.py rc=$?"; tail -12 OUT/pytest-gpu.log
left=$(( 575 - ($(date +%s) - start) ))
timeout $left python3 -m nodrop compare --no-progress --preset mixtral --steps ${STEPS:-120} \
  --fp8-recipes blockwise --capacity-factors --eval-every ${EVAL_EVERY:-20} --eval-batches 2 \
  --checkpoint-every 0 --data runs/corpus --out runs/s/fp8-compare > runs/s/fp8-compare.log 2>&1
el "compare rc=$?"; tail -20 runs/s/fp8-compare.log
find runs/s -name tensorboard -type d -exec rm -rf {} +
find runs/s -name metrics.jsonl -exec gzip {} \;
tar czf OUT/s.tgz -C runs s
