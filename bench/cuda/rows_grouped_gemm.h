// A prototype of the grouped GEMM's rows form without per-group TMA descriptors
// (rows_grouped_gemm.cu), timed beside the engine's pointer-array kernel by
// grouped_matmul_bench.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

enum class RowsTile { kPingpong128x128x64Cluster1x2, kCooperative128x256x64Cluster1x1 };

// How a tile reaches D: from registers with the rows past the group's end masked (any group
// sizes), or by CUTLASS's TMA store, correct only where every group size is a multiple of 128
// (the tile's rows), since a TMA store does not stop at a group's end.
enum class RowsStore { kMaskedRegisters, kTmaWholeRowTiles };

// Workspace bytes rows_grouped_gemm needs for `groups` groups.
size_t rows_grouped_gemm_workspace_bytes(int groups);

// D [rows, n] = A [rows, k] B_g for the rows of each group g (bf16, float32 accumulation):
// `group_sizes` (int32, on the device) splits A's and D's rows into consecutive groups; B_g is
// [k, n] row-major, or with b_transposed [n, k] row-major read transposed; `store` as above.
// False where CUTLASS refuses the problem, groups exceeds 1024 or the workspace is too small.
bool rows_grouped_gemm(RowsTile tile, RowsStore store, bool b_transposed, const void* a,
                       const void* b, void* d, const int32_t* group_sizes, int rows, int n, int k,
                       int groups, void* workspace, size_t workspace_bytes, cudaStream_t stream);
