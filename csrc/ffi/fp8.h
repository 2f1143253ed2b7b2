// Decoding and validation of the FP8 handlers (fp8_cpu.cc, fp8_cuda.cc): the quantisations and
// the grouped matmuls (the forward and the weight gradient), blockwise-scaled and with one scale
// per tensor (tensorwise).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "ffi/common.h"
#include "ffi/permute.h"

namespace nodrop::handlers {

// XLA's FFI has no C++ type for FP8 elements: E4M3 operands are AnyBuffers checked here.
inline ffi::Error require_e4m3(const char* name, const ffi::AnyBuffer& buffer) {
  if (buffer.element_type() == ffi::DataType::F8E4M3FN) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + " must be float8_e4m3fn");
}

// The engine's view of one call: x [M, C] in blocks of 1 x block.
struct QuantizeCall {
  DType dtype;
  int64_t M, C, block;
};

// x [M, C] (float) -> q [M, C] float8_e4m3fn, scale [M, ceil(C / block)] float32.
inline ffi::ErrorOr<QuantizeCall> decode_quantize_fp8(const ffi::AnyBuffer& x,
                                                      const ffi::AnyBuffer& q,
                                                      const ffi::Buffer<ffi::F32>& scale,
                                                      int64_t block) {
  auto dtype = require_float("x", x);
  if (!dtype) return dtype.error();
  NODROP_RETURN_IF_ERROR(require_rank("x", x, 2));
  if (block < 1) {
    return ffi::Error::InvalidArgument("block must be at least 1, got " + std::to_string(block));
  }
  const int64_t M = x.dimensions()[0], C = x.dimensions()[1];
  NODROP_RETURN_IF_ERROR(require_e4m3("q", q));
  NODROP_RETURN_IF_ERROR(require_rank("q", q, 2));
  NODROP_RETURN_IF_ERROR(require_dim("q", q, 0, M));
  NODROP_RETURN_IF_ERROR(require_dim("q", q, 1, C));
  NODROP_RETURN_IF_ERROR(require_rank("scale", scale, 2));
  NODROP_RETURN_IF_ERROR(require_dim("scale", scale, 0, M));
  NODROP_RETURN_IF_ERROR(require_dim("scale", scale, 1, (C + block - 1) / block));
  return QuantizeCall{*dtype, M, C, block};
}

// The operands after the platform's context: x -> q, scale; the attribute block.
template <typename Binding>
auto bind_quantize_fp8(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<int64_t>("block");
}

// given_scale [0] (no scale given: null) or [1] (the engine's given_scale: its one element).
inline ffi::ErrorOr<const float*> decode_given_scale(const ffi::Buffer<ffi::F32>& given_scale) {
  NODROP_RETURN_IF_ERROR(require_rank("given_scale", given_scale, 1));
  const int64_t given = given_scale.dimensions()[0];
  if (given > 1) {
    return ffi::Error::InvalidArgument("given_scale must hold 0 or 1 elements, got " +
                                       std::to_string(given));
  }
  return given == 1 ? given_scale.typed_data() : nullptr;
}

// The engine's view of one permute with the rows' quantisation.
struct PermuteFp8Call {
  RowsShape shape;
  const float* given_scale;  // null: each block's own
};

// permute's operands and results (decode_permute) with given_scale (decode_given_scale) after
// ids, and q [T*k, H] float8_e4m3fn and scale [T*k, ceil(H / 128)] float32: the rows'
// quantisation.
inline ffi::ErrorOr<PermuteFp8Call> decode_permute_fp8(const ffi::AnyBuffer& x,
                                                       const ffi::Buffer<ffi::S32>& ids,
                                                       const ffi::Buffer<ffi::F32>& given_scale,
                                                       const ffi::AnyBuffer& rows,
                                                       const ffi::Buffer<ffi::S32>& group_sizes,
                                                       const ffi::Buffer<ffi::S32>& row_map,
                                                       const ffi::AnyBuffer& q,
                                                       const ffi::Buffer<ffi::F32>& scale,
                                                       int64_t num_experts) {
  auto s = decode_permute(x, ids, rows, group_sizes, row_map, num_experts);
  if (!s) return s.error();
  auto given = decode_given_scale(given_scale);
  if (!given) return given.error();
  NODROP_RETURN_IF_ERROR(require_e4m3("q", q));
  NODROP_RETURN_IF_ERROR(require_rank("q", q, 2));
  NODROP_RETURN_IF_ERROR(require_dim("q", q, 0, s->T * s->k));
  NODROP_RETURN_IF_ERROR(require_dim("q", q, 1, s->H));
  NODROP_RETURN_IF_ERROR(require_rank("scale", scale, 2));
  NODROP_RETURN_IF_ERROR(require_dim("scale", scale, 0, s->T * s->k));
  NODROP_RETURN_IF_ERROR(require_dim("scale", scale, 1, (s->H + kFp8Block - 1) / kFp8Block));
  return PermuteFp8Call{*s, *given};
}

// The operands after the platform's context: permute's (bind_permute) with given_scale after
// ids, and q and scale after row_map (the CUDA handler returns its workspace after the
// attributes).
template <typename Binding>
auto bind_permute_fp8(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<int64_t>("num_experts")
      .template Attr<bool>("checked");
}

// The engine's view of one weight-gradient quantisation: x [M, C] in G groups of rows.
struct QuantizeTransposedCall {
  DType dtype;
  int64_t M, C, G;
  const float* given_scale;  // null: each block's own
};

// x [M, C] (float), group_sizes [G], given_scale [0] (each block's own scale) or [1] (that one
// for every block) -> q_t [C, P] float8_e4m3fn, scale [PB, C] float32,
// PB = fp8_contract_blocks(M, G), P = 128 * PB.
inline ffi::ErrorOr<QuantizeTransposedCall> decode_quantize_fp8_transposed(
    const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& group_sizes,
    const ffi::Buffer<ffi::F32>& given_scale, const ffi::AnyBuffer& q_t,
    const ffi::Buffer<ffi::F32>& scale) {
  auto dtype = require_float("x", x);
  if (!dtype) return dtype.error();
  NODROP_RETURN_IF_ERROR(require_rank("x", x, 2));
  NODROP_RETURN_IF_ERROR(require_rank("group_sizes", group_sizes, 1));
  auto given = decode_given_scale(given_scale);
  if (!given) return given.error();
  const int64_t M = x.dimensions()[0], C = x.dimensions()[1], G = group_sizes.dimensions()[0];
  const int64_t PB = fp8_contract_blocks(M, G);
  NODROP_RETURN_IF_ERROR(require_e4m3("q_t", q_t));
  NODROP_RETURN_IF_ERROR(require_rank("q_t", q_t, 2));
  NODROP_RETURN_IF_ERROR(require_dim("q_t", q_t, 0, C));
  NODROP_RETURN_IF_ERROR(require_dim("q_t", q_t, 1, kFp8Block * PB));
  NODROP_RETURN_IF_ERROR(require_rank("scale", scale, 2));
  NODROP_RETURN_IF_ERROR(require_dim("scale", scale, 0, PB));
  NODROP_RETURN_IF_ERROR(require_dim("scale", scale, 1, C));
  return QuantizeTransposedCall{*dtype, M, C, G, *given};
}

// The operands after the platform's context: x, group_sizes, given_scale -> q_t, scale; the
// attribute checked.
template <typename Binding>
auto bind_quantize_fp8_transposed(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<bool>("checked");
}

// The engine's view of one re-layout of codes: q [M, C] in G groups of rows.
struct TransposeCodesCall {
  int64_t M, C, G;
};

// q [M, C] float8_e4m3fn, group_sizes [G] -> q_t [C, P] float8_e4m3fn,
// P = 128 * fp8_contract_blocks(M, G) (quantize_fp8_transposed's codes).
inline ffi::ErrorOr<TransposeCodesCall> decode_transpose_fp8_codes(
    const ffi::AnyBuffer& q, const ffi::Buffer<ffi::S32>& group_sizes,
    const ffi::AnyBuffer& q_t) {
  NODROP_RETURN_IF_ERROR(require_e4m3("q", q));
  NODROP_RETURN_IF_ERROR(require_rank("q", q, 2));
  NODROP_RETURN_IF_ERROR(require_rank("group_sizes", group_sizes, 1));
  const int64_t M = q.dimensions()[0], C = q.dimensions()[1], G = group_sizes.dimensions()[0];
  NODROP_RETURN_IF_ERROR(require_e4m3("q_t", q_t));
  NODROP_RETURN_IF_ERROR(require_rank("q_t", q_t, 2));
  NODROP_RETURN_IF_ERROR(require_dim("q_t", q_t, 0, C));
  NODROP_RETURN_IF_ERROR(require_dim("q_t", q_t, 1, kFp8Block * fp8_contract_blocks(M, G)));
  return TransposeCodesCall{M, C, G};
}

// The operands after the platform's context: q, group_sizes -> q_t; the attribute checked.
template <typename Binding>
auto bind_transpose_fp8_codes(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<bool>("checked");
}

// The engine's view of one quantisation of the experts' weights.
struct QuantizeWeightsCall {
  DType dtype;
  int64_t G, K, N;
  const float* given_scale;  // null: each block's own
};

// w [G, K, N] (float), given_scale [0] (each block's own scale) or [G] (expert g's for all its
// blocks) -> q [G, K, N] and scale [G, KB, NB], or with `transposed` q [G, N, K] and scale
// [G, NB, KB] (q float8_e4m3fn, scale float32; KB = ceil(K / 128), NB = ceil(N / 128)).
inline ffi::ErrorOr<QuantizeWeightsCall> decode_quantize_fp8_weights(
    const ffi::AnyBuffer& w, const ffi::Buffer<ffi::F32>& given_scale, const ffi::AnyBuffer& q,
    const ffi::Buffer<ffi::F32>& scale, bool transposed) {
  auto dtype = require_float("w", w);
  if (!dtype) return dtype.error();
  NODROP_RETURN_IF_ERROR(require_rank("w", w, 3));
  const int64_t G = w.dimensions()[0], K = w.dimensions()[1], N = w.dimensions()[2];
  NODROP_RETURN_IF_ERROR(require_rank("given_scale", given_scale, 1));
  const int64_t given = given_scale.dimensions()[0];
  if (given != 0 && given != G) {
    return ffi::Error::InvalidArgument("given_scale must hold 0 or G = " + std::to_string(G) +
                                       " elements, got " + std::to_string(given));
  }
  const int64_t KB = (K + kFp8Block - 1) / kFp8Block, NB = (N + kFp8Block - 1) / kFp8Block;
  const char* q_name = transposed ? "q_t" : "q";
  NODROP_RETURN_IF_ERROR(require_e4m3(q_name, q));
  NODROP_RETURN_IF_ERROR(require_rank(q_name, q, 3));
  NODROP_RETURN_IF_ERROR(require_dim(q_name, q, 0, G));
  NODROP_RETURN_IF_ERROR(require_dim(q_name, q, 1, transposed ? N : K));
  NODROP_RETURN_IF_ERROR(require_dim(q_name, q, 2, transposed ? K : N));
  NODROP_RETURN_IF_ERROR(require_rank("scale", scale, 3));
  NODROP_RETURN_IF_ERROR(require_dim("scale", scale, 0, G));
  NODROP_RETURN_IF_ERROR(require_dim("scale", scale, 1, transposed ? NB : KB));
  NODROP_RETURN_IF_ERROR(require_dim("scale", scale, 2, transposed ? KB : NB));
  return QuantizeWeightsCall{*dtype, G, K, N, given == 0 ? nullptr : given_scale.typed_data()};
}

// The operands after the platform's context: w, given_scale -> q (or q_t), scale.
template <typename Binding>
auto bind_quantize_fp8_weights(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

// The engine's view of one FP8 grouped matmul.
struct Fp8GemmShape {
  int64_t M, K, N, G;
};

// What both ragged-rows forwards take besides their scales: lhs [M, K] and rhs [G, N, K]
// float8_e4m3fn, group_sizes [G] -> out [M, N] bfloat16.
inline ffi::ErrorOr<Fp8GemmShape> decode_fp8_rows(const ffi::AnyBuffer& lhs,
                                                  const ffi::AnyBuffer& rhs,
                                                  const ffi::Buffer<ffi::S32>& group_sizes,
                                                  const ffi::Buffer<ffi::BF16>& out) {
  NODROP_RETURN_IF_ERROR(require_e4m3("lhs", lhs));
  NODROP_RETURN_IF_ERROR(require_e4m3("rhs", rhs));
  NODROP_RETURN_IF_ERROR(require_rank("lhs", lhs, 2));
  NODROP_RETURN_IF_ERROR(require_rank("rhs", rhs, 3));
  NODROP_RETURN_IF_ERROR(require_rank("group_sizes", group_sizes, 1));
  NODROP_RETURN_IF_ERROR(require_rank("out", out, 2));
  Fp8GemmShape s{lhs.dimensions()[0], lhs.dimensions()[1], rhs.dimensions()[1],
                 rhs.dimensions()[0]};
  NODROP_RETURN_IF_ERROR(require_dim("rhs", rhs, 2, s.K));
  NODROP_RETURN_IF_ERROR(require_dim("group_sizes", group_sizes, 0, s.G));
  NODROP_RETURN_IF_ERROR(require_dim("out", out, 0, s.M));
  NODROP_RETURN_IF_ERROR(require_dim("out", out, 1, s.N));
  return s;
}

// decode_fp8_rows's operands with lhs_scales [M, KB] and rhs_scales [G, NB, KB] float32
// (KB = ceil(K / 128), NB = ceil(N / 128)).
inline ffi::ErrorOr<Fp8GemmShape> decode_grouped_matmul_fp8_blockwise(
    const ffi::AnyBuffer& lhs, const ffi::Buffer<ffi::F32>& lhs_scales, const ffi::AnyBuffer& rhs,
    const ffi::Buffer<ffi::F32>& rhs_scales, const ffi::Buffer<ffi::S32>& group_sizes,
    const ffi::Buffer<ffi::BF16>& out) {
  auto s = decode_fp8_rows(lhs, rhs, group_sizes, out);
  if (!s) return s.error();
  const int64_t KB = (s->K + kFp8Block - 1) / kFp8Block, NB = (s->N + kFp8Block - 1) / kFp8Block;
  NODROP_RETURN_IF_ERROR(require_rank("lhs_scales", lhs_scales, 2));
  NODROP_RETURN_IF_ERROR(require_rank("rhs_scales", rhs_scales, 3));
  NODROP_RETURN_IF_ERROR(require_dim("lhs_scales", lhs_scales, 0, s->M));
  NODROP_RETURN_IF_ERROR(require_dim("lhs_scales", lhs_scales, 1, KB));
  NODROP_RETURN_IF_ERROR(require_dim("rhs_scales", rhs_scales, 0, s->G));
  NODROP_RETURN_IF_ERROR(require_dim("rhs_scales", rhs_scales, 1, NB));
  NODROP_RETURN_IF_ERROR(require_dim("rhs_scales", rhs_scales, 2, KB));
  return s;
}

// decode_fp8_rows's operands with lhs_scale [1] (the whole of lhs) and rhs_scales [G] (one per
// expert) float32.
inline ffi::ErrorOr<Fp8GemmShape> decode_grouped_matmul_fp8_tensorwise(
    const ffi::AnyBuffer& lhs, const ffi::Buffer<ffi::F32>& lhs_scale, const ffi::AnyBuffer& rhs,
    const ffi::Buffer<ffi::F32>& rhs_scales, const ffi::Buffer<ffi::S32>& group_sizes,
    const ffi::Buffer<ffi::BF16>& out) {
  auto s = decode_fp8_rows(lhs, rhs, group_sizes, out);
  if (!s) return s.error();
  NODROP_RETURN_IF_ERROR(require_rank("lhs_scale", lhs_scale, 1));
  NODROP_RETURN_IF_ERROR(require_rank("rhs_scales", rhs_scales, 1));
  NODROP_RETURN_IF_ERROR(require_dim("lhs_scale", lhs_scale, 0, 1));
  NODROP_RETURN_IF_ERROR(require_dim("rhs_scales", rhs_scales, 0, s->G));
  return s;
}

// lhs, lhs_scales, rhs, rhs_scales, group_sizes -> out; attribute checked. The CUDA handler
// returns its workspace after these. (Taken by reference: a binding cannot be moved into a
// parameter, and bind_grouped_matmul_fp8_tensorwise passes its own on.)
template <typename Binding>
auto bind_grouped_matmul_fp8_blockwise(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::BF16>>()
      .template Attr<bool>("checked");
}

// The blockwise forward's operands, lhs_scale and rhs_scales in place of its scales (the same
// buffer types); then the attribute fast_accumulation.
template <typename Binding>
auto bind_grouped_matmul_fp8_tensorwise(Binding binding) {
  return bind_grouped_matmul_fp8_blockwise(std::move(binding))
      .template Attr<bool>("fast_accumulation");
}

// What both ragged contractions take besides their scales: lhs_t [K, P] and rhs_t [N, P]
// float8_e4m3fn, group_sizes [G] -> out [G, K, N] bfloat16, where
// P = 128 * fp8_contract_blocks(num_rows, G): the codes quantize_fp8_transposed makes of
// [num_rows, K] and [num_rows, N]. The shape's M is num_rows.
inline ffi::ErrorOr<Fp8GemmShape> decode_fp8_contract(const ffi::AnyBuffer& lhs_t,
                                                      const ffi::AnyBuffer& rhs_t,
                                                      const ffi::Buffer<ffi::S32>& group_sizes,
                                                      const ffi::Buffer<ffi::BF16>& out,
                                                      int64_t num_rows) {
  if (num_rows < 0) {
    return ffi::Error::InvalidArgument("num_rows must be at least 0, got " +
                                       std::to_string(num_rows));
  }
  NODROP_RETURN_IF_ERROR(require_e4m3("lhs_t", lhs_t));
  NODROP_RETURN_IF_ERROR(require_e4m3("rhs_t", rhs_t));
  NODROP_RETURN_IF_ERROR(require_rank("lhs_t", lhs_t, 2));
  NODROP_RETURN_IF_ERROR(require_rank("rhs_t", rhs_t, 2));
  NODROP_RETURN_IF_ERROR(require_rank("group_sizes", group_sizes, 1));
  NODROP_RETURN_IF_ERROR(require_rank("out", out, 3));
  Fp8GemmShape s{num_rows, lhs_t.dimensions()[0], rhs_t.dimensions()[0],
                 group_sizes.dimensions()[0]};
  const int64_t P = kFp8Block * fp8_contract_blocks(s.M, s.G);
  NODROP_RETURN_IF_ERROR(require_dim("lhs_t", lhs_t, 1, P));
  NODROP_RETURN_IF_ERROR(require_dim("rhs_t", rhs_t, 1, P));
  NODROP_RETURN_IF_ERROR(require_dim("out", out, 0, s.G));
  NODROP_RETURN_IF_ERROR(require_dim("out", out, 1, s.K));
  NODROP_RETURN_IF_ERROR(require_dim("out", out, 2, s.N));
  return s;
}

// decode_fp8_contract's operands with lhs_scales [PB, K] and rhs_scales [PB, N] float32,
// PB = fp8_contract_blocks(num_rows, G): one scale per block of 128 rows of each column.
inline ffi::ErrorOr<Fp8GemmShape> decode_grouped_matmul_fp8_blockwise_contract(
    const ffi::AnyBuffer& lhs_t, const ffi::Buffer<ffi::F32>& lhs_scales,
    const ffi::AnyBuffer& rhs_t, const ffi::Buffer<ffi::F32>& rhs_scales,
    const ffi::Buffer<ffi::S32>& group_sizes, const ffi::Buffer<ffi::BF16>& out,
    int64_t num_rows) {
  auto s = decode_fp8_contract(lhs_t, rhs_t, group_sizes, out, num_rows);
  if (!s) return s.error();
  const int64_t PB = fp8_contract_blocks(s->M, s->G);
  NODROP_RETURN_IF_ERROR(require_rank("lhs_scales", lhs_scales, 2));
  NODROP_RETURN_IF_ERROR(require_rank("rhs_scales", rhs_scales, 2));
  NODROP_RETURN_IF_ERROR(require_dim("lhs_scales", lhs_scales, 0, PB));
  NODROP_RETURN_IF_ERROR(require_dim("lhs_scales", lhs_scales, 1, s->K));
  NODROP_RETURN_IF_ERROR(require_dim("rhs_scales", rhs_scales, 0, PB));
  NODROP_RETURN_IF_ERROR(require_dim("rhs_scales", rhs_scales, 1, s->N));
  return s;
}

// decode_fp8_contract's operands with lhs_scale [1] and rhs_scale [1] float32 (the whole of
// each).
inline ffi::ErrorOr<Fp8GemmShape> decode_grouped_matmul_fp8_tensorwise_contract(
    const ffi::AnyBuffer& lhs_t, const ffi::Buffer<ffi::F32>& lhs_scale,
    const ffi::AnyBuffer& rhs_t, const ffi::Buffer<ffi::F32>& rhs_scale,
    const ffi::Buffer<ffi::S32>& group_sizes, const ffi::Buffer<ffi::BF16>& out,
    int64_t num_rows) {
  auto s = decode_fp8_contract(lhs_t, rhs_t, group_sizes, out, num_rows);
  if (!s) return s.error();
  NODROP_RETURN_IF_ERROR(require_rank("lhs_scale", lhs_scale, 1));
  NODROP_RETURN_IF_ERROR(require_rank("rhs_scale", rhs_scale, 1));
  NODROP_RETURN_IF_ERROR(require_dim("lhs_scale", lhs_scale, 0, 1));
  NODROP_RETURN_IF_ERROR(require_dim("rhs_scale", rhs_scale, 0, 1));
  return s;
}

// lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes -> out; attributes num_rows and checked.
// The CUDA handler returns its workspace after these. (Taken by reference, as
// bind_grouped_matmul_fp8_blockwise.)
template <typename Binding>
auto bind_grouped_matmul_fp8_blockwise_contract(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::BF16>>()
      .template Attr<int64_t>("num_rows")
      .template Attr<bool>("checked");
}

// The blockwise contraction's operands, lhs_scale and rhs_scale in place of its scales (the same
// buffer types); then the attribute fast_accumulation.
template <typename Binding>
auto bind_grouped_matmul_fp8_tensorwise_contract(Binding binding) {
  return bind_grouped_matmul_fp8_blockwise_contract(std::move(binding))
      .template Attr<bool>("fast_accumulation");
}

}  // namespace nodrop::handlers
