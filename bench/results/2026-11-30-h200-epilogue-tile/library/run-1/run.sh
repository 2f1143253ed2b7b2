# The library with the 128x64 epilogue subtile on weight gradients (cooperative 128x256): tests, memcheck on its small cases, the kernel benchmark, DeepSeek-V3 EP8 against torch.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$(dirname $(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)):${LD_LIBRARY_PATH:-}
nvidia-smi -L > $OUT/gpu.txt; B=.cuda-bin
start=$(date +%s); t() { echo "[$(( $(date +%s) - start )) s] $*"; }
$B/nodrop_cuda_tests --gtest_brief=1 > $OUT/tests.log 2>&1; t "nodrop_cuda_tests exit $?"
$B/nodrop_cuda_moe_tests --gtest_brief=1 >> $OUT/tests.log 2>&1; t "nodrop_cuda_moe_tests exit $?"
grep -h "PASSED\|FAILED\|tests ran" $OUT/tests.log
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 $B/nodrop_cuda_tests --gtest_brief=1 --gtest_filter='*/uneven_contract_*coop1x1*:*/empty_groups_contract_*coop1x1*:*/int32_extremes_contract_bf16_bf16_coop1x1*' > $OUT/memcheck.log 2>&1; t "memcheck exit $?"; tail -3 $OUT/memcheck.log
timeout 60 $B/nodrop_cuda_bench '--shapes=DeepSeek-V3 EP8 rank,Mixtral-8x7B' --iters=150 --warmup=30 > $OUT/gemm-bench.md 2> $OUT/gemm-bench.err; t "bench exit $?"
grep "DeepSeek\|Mixtral" $OUT/gemm-bench.md | grep -v "^|.*shape" | head -20
cp $B/libnodrop_ffi_cuda.so nodrop/; export PYTHONPATH=$PWD
timeout 170 python3 bench/gpu_moe.py --out $OUT/moe --only gemm --shapes DeepSeek-V3-EP8 > $OUT/moe.log 2>&1; t "gpu_moe exit $?"
grep -A12 "## Targets" $OUT/moe/gpu-moe.md; grep "DeepSeek" $OUT/moe/gpu-moe.md | head -6
