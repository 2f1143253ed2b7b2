# GPU round 1 (2026-12-03, evening): two FP8 changes, binaries built on the development machine
# (nvcc 13.0, sm_90a, stripped) and carried as build/gpulib/round8.tar.xz beside the tree's
# build/gpulib/bundle.tar.xz (the benchmark of 2dbb256's engine, `t4`: 4 tiles per thread block).
# 1. The transposed quantiser's tiles per thread block, now chosen per call (w1, w2, w4: 4, 2 or 1
#    tiles, the most that still fill the GPU kTransposedMinWaves = 1, 2 or 4 times), against t4,
#    in turns, twice.
# 2. A second FP8 weight-gradient kernel, pingpong 64x128x128 (NODROP_FP8_CONTRACT_TILE), timed
#    with the others by --configs=all; its GoogleTest cases, and memcheck and racecheck on them
#    and on the quantiser's.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/fp8/logs /tmp/b /tmp/n
L=$OUT/fp8/logs
exec > >(tee -a $OUT/fp8/round.log) 2>&1
tar xJf build/gpulib/bundle.tar.xz -C /tmp/b; tar xJf build/gpulib/round8.tar.xz -C /tmp/n
S=mixtral,qwen3,dsv3,dsv3-down,mixtral-gate-up,mixtral-down
for turn in 1 2; do
  for v in t4 w1 w2 w4; do
    bin=/tmp/n/$v/nodrop_cuda_fp8_bench; [ $v = t4 ] && bin=/tmp/b/nodrop_cuda_fp8_bench
    timeout 60 $bin --mode=training --iters=50 --shapes=$S > $L/training-$v-$turn.md 2>&1
    el "training $v turn $turn rc=$?"
  done
done
for turn in 1 2; do for v in t4 w1 w2 w4; do
  echo "$v turn $turn"; grep -h -A8 "^| shape | rows" $L/training-$v-$turn.md | grep "^| [a-z]"
done; done
timeout 150 /tmp/n/w2/nodrop_cuda_fp8_bench --mode=training --configs=all --iters=30 --shapes=$S \
  > $L/training-configs-all.md 2>&1; el "training --configs=all rc=$?"; grep -i "weight\|wgrad\|contract" $L/training-configs-all.md | head -40
timeout 60 /tmp/n/nodrop_tile_rule_tests > $L/tile-rule-tests.log 2>&1; el "tile rule tests rc=$?"; tail -1 $L/tile-rule-tests.log
timeout 200 /tmp/n/nodrop_cuda_tests --gtest_filter='*Fp8*' > $L/cuda-tests-fp8.log 2>&1; el "cuda tests *Fp8* rc=$?"; tail -3 $L/cuda-tests-fp8.log
for v in w1 w2 w4; do
  timeout 60 /tmp/n/$v/nodrop_cuda_moe_tests --gtest_filter='*QuantizeFp8*' > $L/moe-tests-quantize-$v.log 2>&1; el "quantiser tests $v rc=$?"; tail -1 $L/moe-tests-quantize-$v.log
done
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool --print-limit 5 /tmp/n/nodrop_cuda_tests \
    --gtest_filter='*CudaFp8Contract*' > $L/$tool-contract.log 2>&1; el "$tool contract rc=$?"; tail -2 $L/$tool-contract.log
  timeout 100 compute-sanitizer --tool $tool --print-limit 5 /tmp/n/w2/nodrop_cuda_moe_tests \
    --gtest_filter='*QuantizeFp8*' > $L/$tool-quantize.log 2>&1; el "$tool quantiser rc=$?"; tail -2 $L/$tool-quantize.log
done
tar czf $OUT/fp8/logs.tgz -C $OUT/fp8 logs && rm -rf $L; ls $OUT/fp8
