# Where the DeepSeek-V3 EP8 weight gradient's warps stall: PC sampling per SASS instruction (coop 128x256 1x1, launch 53; ping-pong 1x2, launch 41).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$(dirname $(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)):${LD_LIBRARY_PATH:-}
NCU=/usr/local/cuda/bin/ncu
args=('--shapes=DeepSeek-V3 EP8 rank' --sizes=uniform --tiles=all --iters=2 --warmup=1)
for pair in coop:53 pingpong:41; do
  name=${pair%%:*}; skip=${pair#*:}
  timeout 200 $NCU --section WarpStateStats --section SourceCounters --section SpeedOfLight -k regex:device_kernel --launch-skip $skip --launch-count 1 \
    -o $OUT/wgrad-$name .cuda-bin/nodrop_cuda_bench "${args[@]}" > $OUT/wgrad-$name.log 2>&1
  echo "$name exit $?"
  $NCU -i $OUT/wgrad-$name.ncu-rep --page source --csv --print-source sass > $OUT/wgrad-$name-sass.csv 2> $OUT/wgrad-$name-sass.err
  echo "sass exit $? $(wc -l < $OUT/wgrad-$name-sass.csv) lines"
  $NCU -i $OUT/wgrad-$name.ncu-rep --page details --print-details all > $OUT/wgrad-$name-details.txt 2>&1
done
head -3 $OUT/wgrad-coop-sass.csv | cut -c1-600
