// CUTLASS's batched GEMM with two of nodrop's grouped tiles and cuBLAS's (cutlass_batched_gemm.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

// The first two are nodrop's; the other two are the tile cuBLAS's batched GEMM runs at most of
// the benchmark's forward and input-gradient shapes (its nvjet kernels' "256x128 ... 1x2", in
// cuBLAS's column-major terms 256 output columns by 128 rows; bench/results/
// 2026-12-04-h200-rows-form, round 4) on either cluster, since the name does not say which
// dimension its cluster's 2 runs along.
enum class BatchedTile {
  kPingpong128x128x64Cluster1x2,
  kCooperative128x256x64Cluster1x1,
  kCooperative128x256x64Cluster2x1,
  kCooperative128x256x64Cluster1x2,
};

// D_l [rows, n] = A_l [rows, k] B_l for l < batch (bf16, packed batches): B_l [k, n] row-major,
// or with b_transposed [n, k] row-major read transposed. False where CUTLASS refuses the
// problem or the workspace is too small.
bool cutlass_batched_gemm(BatchedTile tile, bool b_transposed, const void* a, const void* b,
                          void* d, int rows, int n, int k, int batch, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream);
