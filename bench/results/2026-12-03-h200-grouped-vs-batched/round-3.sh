# GPU round 3 (2026-12-03, evening): the benchmark now checks the CUTLASS batched peer's output
# against cuBLAS's batched GEMM before timing it (max |difference| / max |cuBLAS| <= 0.01, or it
# stops). Every shape with equal groups, few calls: a check, not a timing. Built on the
# development machine (nvcc 13.0, sm_90a, stripped), carried as build/gpulib/round12.tar.xz.
set -u
mkdir -p $OUT/gb /tmp/n12
tar xJf build/gpulib/round12.tar.xz -C /tmp/n12
timeout 240 /tmp/n12/nodrop_cuda_bench --sizes=uniform --iters=5 --warmup=1 > $OUT/gb/round-3.md 2> $OUT/gb/round-3.err
echo "rc=$?" >> $OUT/gb/round-3.err
tail -3 $OUT/gb/round-3.err; grep -c "^| " $OUT/gb/round-3.md
