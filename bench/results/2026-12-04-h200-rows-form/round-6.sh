# GPU round 6 (2026-12-04): the benchmark after its two output checks became one (expect_close):
# the edge cases, then Qwen3 with equal (CUTLASS peers checked against cuBLAS) and router-like
# sizes (the prototype checked against nodrop), 20 calls after 5. A check, not a timing round.
set -u
mkdir -p /tmp/rf; tar xJf build/gpulib/rows-form.tar.xz -C /tmp/rf; B=/tmp/rf/nodrop_cuda_bench
cublas=$(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=${cublas:+$(dirname "$cublas"):}${LD_LIBRARY_PATH:-}
timeout 150 $B --shapes=Qwen3-30B-A3B --sizes=uniform,router-like --iters=20 --warmup=5 2>&1 | tee $OUT/round-6.log
echo "rc=${PIPESTATUS[0]}" | tee -a $OUT/round-6.log
