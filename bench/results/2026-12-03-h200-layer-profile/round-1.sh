# GPU round (2026-12-03, evening), on main (f74688d) with main's engine
# (build/gpulib/bundle.tar.xz: 2dbb256's, unchanged since; round9.tar.xz: its nodrop_cuda_bench
# and nodrop_cuda_tests, stripped):
# 1. Where the MoE layer's forward+backward time goes, dropless against capacity 1.0, kernel by
#    kernel (`bench/gpu_profile.py layer`), for the three layer shapes of issue 19's 1.10x target.
# 2. DeepSeek-V3 EP8's forward with uniform groups (issue 19's one forward below torch, 0.98x in
#    2026-12-03-h200-moe-peers): every bf16 tile, at the power limit (150 timed calls after 30).
# 3. compute-sanitizer racecheck, to list every hazard site, on the FP8 kernels' long-K cases (the
#    weight gradient's one_group, the forward's long_k: more K tiles than pipeline stages).
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/lp/logs /tmp/b /tmp/n9
L=$OUT/lp/logs
exec > >(tee -a $OUT/lp/round.log) 2>&1
[ -f /tmp/b/libnodrop_ffi_cuda.so ] || tar xJf build/gpulib/bundle.tar.xz -C /tmp/b
tar xJf build/gpulib/round9.tar.xz -C /tmp/n9
export PYTHONPATH=$PWD NODROP_CACHE=$PWD/runs/cache PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=/tmp/b/lib
cp /tmp/b/libnodrop_ffi_cuda.so /tmp/b/libnodrop_ffi_cpu.so nodrop/
timeout 300 python3 bench/gpu_profile.py layer --shapes Qwen3-30B-A3B,DeepSeek-V2-Lite,Mixtral-8x7B \
  --out runs/layer-profile > $L/layer-profile.log 2>&1; el "layer profile rc=$?"
grep "^###" runs/layer-profile/layer-profile.md
timeout 120 /tmp/n9/nodrop_cuda_bench --shapes="DeepSeek-V3 EP8 rank" --sizes=uniform --tiles=all \
  --iters=150 --warmup=30 > $L/dsv3-forward-tiles.md 2>&1; el "dsv3 tiles rc=$?"; grep -i "forward" $L/dsv3-forward-tiles.md | head -12
for t in 'Shapes/CudaFp8ContractTest.*/one_group_*' 'Shapes/CudaFp8BlockwiseTest.*/long_k_*'; do
  name=$(echo "$t" | cut -d/ -f2 | cut -d. -f1)
  timeout 150 compute-sanitizer --tool racecheck --print-limit 40 /tmp/n9/nodrop_cuda_tests \
    --gtest_filter="$t" > $L/racecheck-$name.log 2>&1; el "racecheck $t rc=$?"; grep -E "OK|FAILED|SUMMARY" $L/racecheck-$name.log | cut -c1-160
done
cp runs/layer-profile/layer-profile.md $L/
tar czf $OUT/lp/logs.tgz -C $OUT/lp logs && rm -rf $L; ls $OUT/lp
