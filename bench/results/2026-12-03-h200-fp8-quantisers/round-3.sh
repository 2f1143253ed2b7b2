# GPU round 3 (2026-12-03): the bf16 grouped GEMM's CUTLASS workspace zeroed before each call
# (grouped_matmul.cu), the benchmark built on the development machine and carried as
# build/gpulib. The six training-benchmark shapes in one process (the order that stopped with an
# illegal instruction in rounds 1 and 2), then initcheck on dsv3 alone.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/r3
exec > >(tee -a $OUT/r3/round.log) 2>&1
B=build/gpulib
timeout 70 $B/nodrop_cuda_fp8_bench --mode=training --iters=30 --shapes=mixtral,qwen3,dsv3,dsv3-down,mixtral-gate-up,mixtral-down 2>&1; el "six shapes in one process rc=$?"
timeout 80 compute-sanitizer --tool initcheck --print-limit 3 $B/nodrop_cuda_fp8_bench --mode=training --iters=1 --warmup=0 --shapes=dsv3 > $OUT/r3/initcheck-dsv3.log 2>&1; el "initcheck dsv3 rc=$?"; grep -o "at void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<[^,]*, cutlass::gemm::collective::CollectiveMma<cutlass::gemm::[A-Za-z0-9]*" $OUT/r3/initcheck-dsv3.log | sort | uniq -c; tail -2 $OUT/r3/initcheck-dsv3.log
