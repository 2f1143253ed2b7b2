// CUTLASS's batched GEMM with two of nodrop's grouped tiles (cutlass_batched_gemm.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

enum class BatchedTile { kPingpong128x128x64Cluster1x2, kCooperative128x256x64Cluster1x1 };

// D_l [rows, n] = A_l [rows, k] B_l for l < batch (bf16, packed batches): B_l [k, n] row-major,
// or with b_transposed [n, k] row-major read transposed. False where CUTLASS refuses the
// problem or the workspace is too small.
bool cutlass_batched_gemm(BatchedTile tile, bool b_transposed, const void* a, const void* b,
                          void* d, int rows, int n, int k, int batch, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream);
