// CPU grouped matmul: one oneDNN matmul per non-empty group.
//
// oneDNN is the GEMM library XLA itself uses on x86; its bf16 path runs on AMX / AVX512-BF16
// where the CPU has them. The primitive is created once per call with the group dimension
// (rows, or the contraction for the weight gradient) left as a run-time dimension, so every
// group reuses it. float16 has no oneDNN CPU GEMM: it is computed in float32.
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "engine/cpu/convert.h"
#include "nodrop/engine.h"

namespace nodrop::cpu {
namespace {

using dnnl::memory;
using Dims = memory::dims;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

memory::data_type to_dnnl(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return memory::data_type::f32;
    case DType::kFloat16: return memory::data_type::f16;
    case DType::kBFloat16: return memory::data_type::bf16;
  }
  return memory::data_type::undef;
}

// Inputs in the dtype oneDNN computes with: bf16 and f32 as they are, f16 widened to f32.
struct ComputeInputs {
  DType dtype;
  const void* lhs;
  const void* rhs;
  std::vector<float> lhs_f32, rhs_f32;

  ComputeInputs(const void* lhs_in, int64_t lhs_elems, const void* rhs_in, int64_t rhs_elems,
                DType in_dtype)
      : dtype(in_dtype), lhs(lhs_in), rhs(rhs_in) {
    if (in_dtype != DType::kFloat16) return;
    dtype = DType::kFloat32;
    lhs_f32.resize(lhs_elems);
    rhs_f32.resize(rhs_elems);
    to_float(lhs_in, in_dtype, lhs_elems, lhs_f32.data());
    to_float(rhs_in, in_dtype, rhs_elems, rhs_f32.data());
    lhs = lhs_f32.data();
    rhs = rhs_f32.data();
  }
};

// The output as oneDNN writes it: directly when oneDNN can produce out_dtype from the compute
// dtype, else into a float32 buffer that finish() converts.
struct ComputeOutput {
  DType dtype;
  void* data;
  std::vector<float> staging;
  void* final_data;
  DType final_dtype;
  int64_t elems;

  ComputeOutput(void* out, DType out_dtype, DType compute_dtype, int64_t n)
      : dtype(out_dtype), data(out), final_data(out), final_dtype(out_dtype), elems(n) {
    const bool direct = out_dtype == DType::kFloat32 || out_dtype == compute_dtype;
    if (direct) return;
    dtype = DType::kFloat32;
    staging.resize(n);
    data = staging.data();
  }
  void finish() {
    if (!staging.empty()) from_float(staging.data(), elems, final_dtype, final_data);
  }
};

// oneDNN 3 dropped the operation descriptors of 2.x (Debian 12 ships 2.6).
dnnl::matmul make_matmul(const memory::desc& src, const memory::desc& wei, const memory::desc& dst) {
#if DNNL_VERSION_MAJOR >= 3
  return dnnl::matmul(dnnl::matmul::primitive_desc(cpu_engine(), src, wei, dst));
#else
  return dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, dst), cpu_engine()));
#endif
}

void zero(void* data, DType dtype, int64_t elems) {
  if (elems > 0) std::memset(data, 0, elems * dtype_size(dtype));
}

const char* byte_ptr(const void* p, int64_t elem_offset, DType dtype) {
  return static_cast<const char*>(p) + elem_offset * dtype_size(dtype);
}

}  // namespace

Status grouped_matmul(const void* lhs, const void* rhs, DType in_dtype, const int32_t* group_sizes,
                      int64_t M, int64_t K, int64_t N, int64_t G, bool transpose_rhs, void* out,
                      DType out_dtype, bool checked) {
  std::vector<int64_t> offsets(G + 1);
  Status status = clamp_group_offsets(group_sizes, G, M, checked, "group_sizes", offsets.data());
  if (!status.ok()) return status;
  const int64_t used_rows = offsets[G];
  // Rows that no group covers are zero; so is everything when the contraction is empty.
  zero(static_cast<char*>(out) + used_rows * N * dtype_size(out_dtype), out_dtype,
       (M - used_rows) * N);
  if (N == 0 || used_rows == 0) return Status::Ok();
  if (K == 0) {
    zero(out, out_dtype, used_rows * N);
    return Status::Ok();
  }
  try {
    ComputeInputs in(lhs, M * K, rhs, G * K * N, in_dtype);
    ComputeOutput result(out, out_dtype, in.dtype, M * N);
    const memory::data_type src_t = to_dnnl(in.dtype), dst_t = to_dnnl(result.dtype);
    const Dims wei_strides = transpose_rhs ? Dims{1, K} : Dims{N, 1};
    const auto rt = DNNL_RUNTIME_DIM_VAL;
    dnnl::matmul matmul = make_matmul(memory::desc({rt, K}, src_t, {K, 1}),
                                      memory::desc({K, N}, src_t, wei_strides),
                                      memory::desc({rt, N}, dst_t, {N, 1}));
    dnnl::stream stream(cpu_engine());
    for (int64_t g = 0; g < G; ++g) {
      const int64_t rows = offsets[g + 1] - offsets[g];
      if (rows == 0) continue;
      memory src({{rows, K}, src_t, {K, 1}}, cpu_engine(),
                 const_cast<char*>(byte_ptr(in.lhs, offsets[g] * K, in.dtype)));
      memory wei({{K, N}, src_t, wei_strides}, cpu_engine(),
                 const_cast<char*>(byte_ptr(in.rhs, g * K * N, in.dtype)));
      memory dst({{rows, N}, dst_t, {N, 1}}, cpu_engine(),
                 const_cast<char*>(byte_ptr(result.data, offsets[g] * N, result.dtype)));
      matmul.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
    }
    stream.wait();
    result.elems = used_rows * N;  // rows past the groups were zeroed in the output already
    result.finish();
  } catch (const std::exception& e) {
    return Status::Error(std::string("grouped_matmul: oneDNN failed: ") + e.what());
  }
  return Status::Ok();
}

Status grouped_matmul_contract(const void* lhs, const void* rhs, DType in_dtype,
                               const int32_t* group_sizes, int64_t M, int64_t K, int64_t N,
                               int64_t G, void* out, DType out_dtype, bool checked) {
  std::vector<int64_t> offsets(G + 1);
  Status status = clamp_group_offsets(group_sizes, G, M, checked, "group_sizes", offsets.data());
  if (!status.ok()) return status;
  if (K == 0 || N == 0 || G == 0) return Status::Ok();
  try {
    ComputeInputs in(lhs, M * K, rhs, M * N, in_dtype);
    ComputeOutput result(out, out_dtype, in.dtype, G * K * N);
    const memory::data_type src_t = to_dnnl(in.dtype), dst_t = to_dnnl(result.dtype);
    const auto rt = DNNL_RUNTIME_DIM_VAL;
    // out[g] [K, N] = lhs_g^T [K, rows] @ rhs_g [rows, N]: lhs_g read through transposed strides.
    dnnl::matmul matmul = make_matmul(memory::desc({K, rt}, src_t, {1, K}),
                                      memory::desc({rt, N}, src_t, {N, 1}),
                                      memory::desc({K, N}, dst_t, {N, 1}));
    dnnl::stream stream(cpu_engine());
    for (int64_t g = 0; g < G; ++g) {
      const int64_t rows = offsets[g + 1] - offsets[g];
      char* dst_ptr = const_cast<char*>(byte_ptr(result.data, g * K * N, result.dtype));
      if (rows == 0) {  // an expert without tokens gets a zero gradient
        zero(dst_ptr, result.dtype, K * N);
        continue;
      }
      memory src({{K, rows}, src_t, {1, K}}, cpu_engine(),
                 const_cast<char*>(byte_ptr(in.lhs, offsets[g] * K, in.dtype)));
      memory wei({{rows, N}, src_t, {N, 1}}, cpu_engine(),
                 const_cast<char*>(byte_ptr(in.rhs, offsets[g] * N, in.dtype)));
      memory dst({{K, N}, dst_t, {N, 1}}, cpu_engine(), dst_ptr);
      matmul.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
    }
    stream.wait();
    result.finish();
  } catch (const std::exception& e) {
    return Status::Error(std::string("grouped_matmul_contract: oneDNN failed: ") + e.what());
  }
  return Status::Ok();
}

}  // namespace nodrop::cpu
