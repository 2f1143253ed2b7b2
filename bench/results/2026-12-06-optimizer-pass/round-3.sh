# GPU round 3 (2026-12-06): round 2's training steps again, "after" first in each preset (round
# 2 ran "before" first), bench/gpu_profile.py's errors kept (in round 2 it failed, its output
# discarded); first the tail benchmark on qwen3 with its optimized HLO kept (packed). Carried
# as round 2: build/gpulib/cuda.tar.xz and build/gpulib/trainer_before.py.
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
timeout 100 python3 bench/results/2026-12-06-optimizer-pass/tail_bench.py qwen3 \
  --out $OUT/r/tail --iters 10
el "tail rc=$?"; pack
rm -rf /tmp/before && cp -r . /tmp/before && cp build/gpulib/trainer_before.py /tmp/before/nodrop/train/trainer.py
for preset in qwen3 mixtral deepseek; do
  for version in after before; do
    [ $(left) -lt 100 ] && { el "no time for $preset $version"; break 2; }
    root=$PWD; [ $version = before ] && root=/tmp/before
    (cd $root && timeout $(( $(left) - 20 )) python3 -m nodrop train --preset $preset --steps 40 \
      --eval-every 40 --eval-batches 1 --checkpoint-every 0 --profile 31:33 --no-progress \
      --out /tmp/runs/$preset-$version > $OUT/r/train-$preset-$version.log 2>&1)
    el "train $preset $version rc=$?"; tail -2 $OUT/r/train-$preset-$version.log
  done
  timeout 60 python3 bench/gpu_profile.py runs /tmp/runs/$preset-before /tmp/runs/$preset-after \
    --out $OUT/r/profile-$preset > $OUT/r/profile-$preset.log 2>&1
  el "profile $preset rc=$?"; sed -n 1,8p $OUT/r/profile-$preset/profile.md 2>/dev/null
  mkdir -p $OUT/r/runs && for v in before after; do
    mkdir -p $OUT/r/runs/$preset-$v && cp /tmp/runs/$preset-$v/*.json* $OUT/r/runs/$preset-$v/ 2>/dev/null
  done
  pack
done
el done
pack; rm -rf $OUT/r/runs $OUT/r/profile-* $OUT/r/train-*.log $OUT/r/tail
