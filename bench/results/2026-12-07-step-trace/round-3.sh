# GPU round 3 (2026-12-07, session 6): round 2 found the cooperative 128x256 tile 17% faster than
# the tile rule's ping-pong 128x128 on the `mixtral` preset's gate+up forward (a contraction of
# 2048) on an H100, where the H200 (2026-11-30) had ping-pong 3% ahead. Every tile at the
# benchmark's shapes with contractions of 2048 or less, router-like group sizes, on an H100.
set -u
mkdir -p $OUT/r
exec > >(tee -a $OUT/r/round.log) 2>&1
nvidia-smi -L
tar xJf build/gpulib/deps.tar.xz -C / --skip-old-files
mkdir -p build/gpu && tar xJf build/gpulib/bench.tar.xz -C build/gpu
timeout 420 build/gpu/nodrop_cuda_bench --tiles=all --sizes=router-like \
  --shapes="Qwen3-30B-A3B,DeepSeek-V2-Lite,DeepSeek-V2-Lite layer gate+up,DeepSeek-V2-Lite layer down,Qwen3-30B-A3B 2k tokens,DeepSeek-V3 EP8 rank" \
  --csv=$OUT/r/tiles.csv > $OUT/r/tiles.md 2> $OUT/r/tiles.err
echo "rc=$?"
tar czf $OUT/r.tgz -C $OUT r; rm -rf $OUT/r
