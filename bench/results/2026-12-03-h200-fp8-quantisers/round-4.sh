# GPU round 4 (2026-12-03): the quantisers' scale rule (1 where amax / 448 is below float32's
# smallest normal number) and their speed; what precedes the illegal instruction; the mixtral
# preset in FP8 against bf16. Binaries built on the development machine and carried as
# build/gpulib (stripped; build/gpulib/old: nodrop_cuda_fp8_bench of 3ca813c, the quantisers
# before 72c04d9).
# 1. Engine tests of the quantisers (bitwise the CPU engine), memcheck, racecheck.
# 2. The training benchmark one shape per process (bandwidth tables), new and old quantisers.
# 3. Pairs of shapes in one process: which earlier shape makes dsv3 stop; memcheck on that pair.
# 4. pytest: the quantisers' tests through JAX on the GPU, the FP8 GPU tests.
# 5. nodrop compare: mixtral dropless in bf16 and in FP8 blockwise, 120 steps, seed 0.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r4/logs
L=$OUT/r4/logs  # packed into logs.tgz at the end (the tool returns 8 files)
exec > >(tee -a $OUT/r4/round.log) 2>&1
B=build/gpulib
$B/nodrop_cuda_moe_tests --gtest_brief=1 --gtest_filter='*QuantizeFp8*' 2>&1 | tail -8; el "quantize tests rc=${PIPESTATUS[0]}"
for tool in memcheck racecheck; do
  timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 $B/nodrop_cuda_moe_tests --gtest_brief=1 \
    --gtest_filter='*QuantizeFp8*' 2>&1 | tail -3; el "$tool quantizers rc=${PIPESTATUS[0]}"
done
for s in mixtral qwen3 dsv3 dsv3-down mixtral-gate-up mixtral-down; do
  timeout 40 $B/nodrop_cuda_fp8_bench --mode=training --iters=30 --shapes=$s > $L/training-$s.md 2>&1; el "new $s rc=$?"
  timeout 40 $B/old/nodrop_cuda_fp8_bench --mode=training --iters=30 --shapes=$s > $L/training-old-$s.md 2>&1; el "old $s rc=$?"
done
echo "new:"; grep -h "^| [a-z]" $L/training-[a-z]*.md | grep -v "training-old" | sort -u
echo "old:"; grep -h "^| [a-z]" $L/training-old-*.md | sort -u
for pair in qwen3,dsv3 mixtral,dsv3 dsv3-down,dsv3 mixtral-down,dsv3 dsv3,qwen3; do
  timeout 40 $B/nodrop_cuda_fp8_bench --mode=training --iters=3 --warmup=1 --shapes=$pair 2>&1 | tail -1; el "pair $pair rc=${PIPESTATUS[0]}"
done
CUDA_LAUNCH_BLOCKING=1 timeout 150 compute-sanitizer --tool memcheck --print-limit 5 $B/nodrop_cuda_fp8_bench --mode=training --iters=1 --warmup=0 --shapes=qwen3,dsv3 > $L/memcheck-qwen3-dsv3.log 2>&1; el "memcheck qwen3,dsv3 rc=$?"; grep -v "^=========     \(Host Frame\|at void\)" $L/memcheck-qwen3-dsv3.log | head -c 3000; tail -3 $L/memcheck-qwen3-dsv3.log
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1
cp $B/libnodrop_ffi_cuda.so nodrop/
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/python/test_fp8.py -k "small or zero_block or saturate or quantize_rows" 2>&1 | tail -4; el "pytest quantisers on the GPU rc=${PIPESTATUS[0]}"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu.py -k "fp8" 2>&1 | tail -4; el "pytest test_gpu fp8 rc=${PIPESTATUS[0]}"
timeout $(left 585) python3 -m nodrop compare --preset mixtral --steps 120 --seeds 0 --fp8-recipes blockwise \
  --capacity-factors --eval-every 20 --eval-batches 2 --checkpoint-every 0 \
  --out runs/compare > $L/compare.log 2>&1; el "compare rc=$?"; grep -v "^\s*$" $L/compare.log | tail -25
tar czf $OUT/r4/compare.tgz -C runs compare 2>/dev/null; tar czf $OUT/r4/logs.tgz -C $OUT/r4 logs && rm -rf $L; ls $OUT/r4
