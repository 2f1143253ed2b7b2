# The round on this session's binaries, then the Mixtral layer at the power limit.
R=$OUT/r; mkdir -p $R
bash scripts/gpu-check.sh $R/round .cuda-bin > $R/gpu-check.out 2>&1; echo "gpu-check exit $?" | tee -a $R/gpu-check.out
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$(dirname $(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)):${LD_LIBRARY_PATH:-}
export PYTHONPATH=$PWD:$PWD/bench
OUT=$R timeout 170 python3 .cuda-bin/layer_sustained.py 2>&1 | grep -v Warning > $R/layer-sustained.log; echo "layer exit $?"
tail -40 $R/round/summary.md; cat $R/layer-sustained.log
cd $OUT && tar czf r.tgz r && rm -rf r
