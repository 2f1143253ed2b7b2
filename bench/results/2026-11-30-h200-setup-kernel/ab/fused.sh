# The fused setup kernel: GPU tests, sanitizer, then old/new A/B timing.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$(dirname $(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)):${LD_LIBRARY_PATH:-}
export PYTHONPATH=$PWD:$PWD/bench
R=$OUT/f; mkdir -p $R; B=.cuda-bin
start=$(date +%s)
timeout 200 $B/nodrop_cuda_tests --gtest_brief=1 > $R/tests.log 2>&1; echo "cuda tests exit $? at $(( $(date +%s) - start )) s"
timeout 100 $B/nodrop_cuda_moe_tests --gtest_brief=1 >> $R/tests.log 2>&1; echo "moe tests exit $? at $(( $(date +%s) - start )) s"
tail -3 $R/tests.log
small_gemm='CudaGroupedMatmulGraph.*:*/uneven_*bf16_bf16*:*/empty_groups_*f16_f32*:*/int32_extremes_*bf16_f32*'
for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 $B/nodrop_cuda_tests --gtest_brief=1 --gtest_filter="$small_gemm" 2>&1 | tail -4 >> $R/sanitizer.log
  echo "$tool exit ${PIPESTATUS[0]} at $(( $(date +%s) - start )) s"
done
cat $R/sanitizer.log | grep -i "summary\|hazard\|PASSED\|FAILED"
for lib in old new old new; do
  if [ $lib = old ]; then cp .cuda-bin-old/libnodrop_ffi_cuda.so nodrop/; else cp $B/libnodrop_ffi_cuda.so nodrop/; fi
  echo "== $lib" >> $R/dispatch.log
  timeout 60 python3 $B/dispatch.py 2>&1 | grep -v Warning >> $R/dispatch.log
done
echo "dispatch done at $(( $(date +%s) - start )) s"
for lib in new old; do
  if [ $lib = old ]; then cp .cuda-bin-old/libnodrop_ffi_cuda.so nodrop/; else cp $B/libnodrop_ffi_cuda.so nodrop/; fi
  timeout 120 python3 bench/gpu_gemm_sustained.py --out $R/sustained-$lib --shapes DeepSeek-V3-EP8 --steps 400 --repeats 2 > $R/sustained-$lib.log 2>&1
  echo "sustained $lib exit $? at $(( $(date +%s) - start )) s"
done
cd $OUT && tar czf f.tgz f && rm -rf f
