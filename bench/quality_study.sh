#!/usr/bin/env bash
# The quality study's runs (docs/quality.md): dropless against token dropping at equal steps.
#
#   bench/quality_study.sh cpu OUT   # tiny, 1000 steps, capacity 1.0 and 1.25, seeds 0 and 1,
#                                    # then batch invariance of the trained dropless model
#   bench/quality_study.sh gpu OUT   # small, 2000 steps of 4 x 1024 subword tokens, capacity 1.0
#                                    # and 1.25, seeds 0 and 1; then mixtral, deepseek and qwen3,
#                                    # 300 steps against 1.25, seeds 0 and 1, on 48 MiB of the
#                                    # machine's installed Python packages (bench/make_corpus.py)
#
# Started again with the same OUT, each comparison reuses the runs that finished, so a study cut
# short (a time limit) goes on where it stopped. PYTHON (default python3) runs nodrop.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: bench/quality_study.sh cpu|gpu OUT}
out=${2:?usage: bench/quality_study.sh cpu|gpu OUT}
python=${PYTHON:-python3}
compare() { "$python" -m nodrop compare --no-progress "$@"; }

case $mode in
  cpu)
    compare --steps 1000 --seeds 0 1 --checkpoint-every 1000 --out "$out/tiny"
    "$python" bench/batch_invariance.py "$out/tiny/dropless/seed-0" \
      > "$out/tiny/batch-invariance.md"
    ;;
  gpu)
    # 4 sequences a step: the GPU machine's standard library is 2.5M BPE tokens, which 16 a step
    # would repeat 13 times in 2000 steps (docs/quality.md).
    compare --preset small --batch-size 4 --seeds 0 1 --checkpoint-every 0 --out "$out/small-b4"
    # 300 steps of 16 x 2048 read 9.8M tokens: the corpus (12.6M on the H200 machine) is read
    # once, where the standard library would be read four times.
    [ -d "$out/corpus" ] || "$python" bench/make_corpus.py "$out/corpus" 48
    for preset in mixtral deepseek qwen3; do
      compare --preset "$preset" --steps 300 --capacity-factors 1.25 --seeds 0 1 --eval-every 50 \
        --eval-batches 4 --checkpoint-every 0 --data "$out/corpus" --out "$out/$preset-300"
    done
    ;;
  *)
    echo "bench/quality_study.sh: the mode is cpu or gpu, got $mode" >&2
    exit 2
    ;;
esac
