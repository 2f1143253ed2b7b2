// The per-group GEMM arguments that the setup kernel writes and CUTLASS's grouped kernel reads,
// all in device memory (the caller's workspace), so group sizes never travel to the host; and
// run_grouped_gemm, the kernel launch over such a table.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include <cute/layout.hpp>

#include "nodrop/engine.h"
#include "nodrop/engine_cuda.h"

namespace nodrop::cuda::detail {

// The engine's three grouped products as CUTLASS GEMMs D (M x N) = A (M x K) * B (K x N), where
// CUTLASS indexes B as (N, K). Each operand is "K-major" (K contiguous) or "MN-major".
enum class GemmForm : int32_t {
  kRows,            // A = lhs_g [M_g, K] K-major, B = rhs[g] [K, N] N-major,  D = out_g [M_g, N]
  kRowsTransposed,  // A = lhs_g [M_g, K] K-major, B = rhs[g] [N, K] K-major,  D = out_g [M_g, N]
  kContract,        // A = lhs_g^T [K, M_g] M-major, B = rhs_g [M_g, N] N-major, D = out[g] [K, N]
};

// (M, N, K) of one group's GEMM: CUTLASS's GroupProblemShape element.
using GroupShape = cute::Shape<int, int, int>;

// CuTe strides over (MN, K, L): one run-time leading dimension, unit stride on the contiguous
// mode, no batch mode (each group has its own pointer).
using StrideKMajor = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;
using StrideMNMajor = cute::Stride<cute::Int<1>, int64_t, cute::Int<0>>;

template <GemmForm F>
struct FormStrides;
template <>
struct FormStrides<GemmForm::kRows> {
  using A = StrideKMajor;
  using B = StrideMNMajor;
  using D = StrideKMajor;
};
template <>
struct FormStrides<GemmForm::kRowsTransposed> {
  using A = StrideKMajor;
  using B = StrideKMajor;
  using D = StrideKMajor;
};
template <>
struct FormStrides<GemmForm::kContract> {
  using A = StrideMNMajor;
  using B = StrideMNMajor;
  using D = StrideKMajor;
};

// Device arrays inside the workspace, one entry per group (offsets has G + 1). The strides are
// FormStrides<F> of the call's form; every such stride is 8 bytes.
struct GroupTable {
  int32_t num_groups = 0;
  int64_t* offsets = nullptr;  // clamped row offsets: group g owns rows [offsets[g], offsets[g+1])
  GroupShape* shapes = nullptr;
  const void** ptr_a = nullptr;
  const void** ptr_b = nullptr;
  void** ptr_d = nullptr;
  void* stride_a = nullptr;
  void* stride_b = nullptr;
  void* stride_d = nullptr;
  void* gemm_workspace = nullptr;  // CUTLASS's per-SM copies of the TMA descriptors
  size_t gemm_workspace_bytes = 0;
  int device = 0;
  int sm_count = 0;
  GemmRaster raster = GemmRaster::kAlongM;  // the tile scheduler's walk, never kAuto
  int swizzle = 1;
};

// Runs D_g = A_g * B_g for every group of the table on `stream`; groups without tiles are
// skipped. In is the dtype of A and B, Out that of D; T is never kAuto. Defined in
// cutlass_gemm.cuh and instantiated once per (form, dtypes, tile), each in its own generated file
// (a minute and ~3.5 GB of compiler memory each; generate_instantiations.py).
template <GemmForm F, DType In, DType Out, GemmTile T>
Status run_grouped_gemm(const GroupTable& table, cudaStream_t stream);

}  // namespace nodrop::cuda::detail
