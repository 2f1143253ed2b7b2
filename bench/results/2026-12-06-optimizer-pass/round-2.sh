# GPU round 2 (2026-12-06; run as round-3.sh, renamed when a round 2 that never started was
# dropped): the tail benchmark of the design committed (tree_stats, 3c00e5b), then the whole
# training step before and after, one process each, "before" first: `nodrop train` with steps
# 31-33 traced, then bench/gpu_profile.py over both runs (kernel time per step by region and
# kernel class). Carried: build/gpulib/cuda.tar.xz (libnodrop_ffi_cuda.so of the fresh-clone CI
# build of 14dd931, unchanged since: the change is Python only) and
# build/gpulib/trainer_before.py (`git show 14dd931:nodrop/train/trainer.py`), which a copy of
# the tree runs as "before".
set -u
BUDGET=${BUDGET:-570}
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
mkdir -p $OUT/r /tmp/v
exec > >(tee -a $OUT/r/round.log) 2>&1
pack() { tar czf $OUT/r.tgz --exclude='*tfevents*' --exclude='*.pb' --exclude='*trace.json.gz' \
           --exclude='*.xplane.pb' --exclude='tokenizer*' -C $OUT r; }
tar xJf build/gpulib/cuda.tar.xz -C /tmp/v
nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
export LD_LIBRARY_PATH=/tmp/v/lib PYTHONUNBUFFERED=1 NODROP_CACHE=/tmp/cache
cp /tmp/v/lib/libnodrop_ffi_cuda.so nodrop/
timeout 150 python3 bench/results/2026-12-06-optimizer-pass/tail_bench.py qwen3 mixtral \
  --out $OUT/r/tail --iters 10
el "tail rc=$?"; rm -f $OUT/r/tail/*.hlo.txt; pack
rm -rf /tmp/before && cp -r . /tmp/before && cp build/gpulib/trainer_before.py /tmp/before/nodrop/train/trainer.py
for preset in qwen3 mixtral deepseek; do
  for version in before after; do
    [ $(left) -lt 100 ] && { el "no time for $preset $version"; break 2; }
    root=$PWD; [ $version = before ] && root=/tmp/before
    (cd $root && timeout $(( $(left) - 20 )) python3 -m nodrop train --preset $preset --steps 40 \
      --eval-every 40 --eval-batches 1 --checkpoint-every 0 --profile 31:33 --no-progress \
      --out /tmp/runs/$preset-$version > $OUT/r/train-$preset-$version.log 2>&1)
    el "train $preset $version rc=$?"; tail -2 $OUT/r/train-$preset-$version.log
  done
  timeout 60 python3 bench/gpu_profile.py runs /tmp/runs/$preset-before /tmp/runs/$preset-after \
    --out $OUT/r/profile-$preset > /dev/null 2>&1
  el "profile $preset rc=$?"; sed -n 1,8p $OUT/r/profile-$preset/profile.md 2>/dev/null
  mkdir -p $OUT/r/runs && for v in before after; do
    mkdir -p $OUT/r/runs/$preset-$v && cp /tmp/runs/$preset-$v/*.json* $OUT/r/runs/$preset-$v/ 2>/dev/null
  done
  pack
done
el done
pack; rm -rf $OUT/r/runs $OUT/r/tail
