// CPU grouped matmul on oneDNN matmuls.
//
// oneDNN is the GEMM library XLA itself uses on x86; its bf16 path runs on AMX / AVX512-BF16
// where the CPU has them. One primitive is created per call with the ragged dimensions left as
// run-time dimensions, so every group and every block reuses it. The work is cut into blocks
// (rows of a group; output rows of a weight-gradient group) that the runner spreads over its
// workers; each block is one single-threaded oneDNN call, and every output element is written by
// exactly one block, so there are no atomics. float16 has no oneDNN CPU GEMM, and bfloat16 has
// none on CPUs without AVX-512 (oneDNN 2.6): those are widened to float32.
#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "engine/cpu/convert.h"
#include "engine/cpu/parallel.h"
#include "nodrop/engine_cpu.h"

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

// oneDNN 3 dropped the operation descriptors of 2.x (Debian 12 ships 2.6).
dnnl::matmul make_matmul(const memory::desc& src, const memory::desc& wei, const memory::desc& dst) {
#if DNNL_VERSION_MAJOR >= 3
  return dnnl::matmul(dnnl::matmul::primitive_desc(cpu_engine(), src, wei, dst));
#else
  return dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, dst), cpu_engine()));
#endif
}

// Whether this CPU has a oneDNN bf16 matmul (asked once).
bool bf16_matmul_available() {
  static const bool available = [] {
    const memory::desc bf16({8, 8}, memory::data_type::bf16, memory::format_tag::ab);
    try {
      make_matmul(bf16, bf16, bf16);
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return available;
}

// Inputs in the dtype oneDNN computes with: f32 as it is, bf16 too where the CPU has a bf16
// matmul, anything else widened to f32.
struct ComputeInputs {
  DType dtype;
  const void* lhs;
  const void* rhs;
  std::vector<float> lhs_f32, rhs_f32;

  ComputeInputs(const void* lhs_in, int64_t lhs_elems, const void* rhs_in, int64_t rhs_elems,
                DType in_dtype)
      : dtype(in_dtype), lhs(lhs_in), rhs(rhs_in) {
    if (in_dtype == DType::kFloat32 ||
        (in_dtype == DType::kBFloat16 && bf16_matmul_available())) {
      return;
    }
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

void zero(void* data, DType dtype, int64_t elems) {
  if (elems > 0) std::memset(data, 0, elems * dtype_size(dtype));
}

char* byte_ptr(const void* p, int64_t elem_offset, DType dtype) {
  return const_cast<char*>(static_cast<const char*>(p)) + elem_offset * dtype_size(dtype);
}

// A block of work: `length` units starting at `begin` inside group `group`.
struct Block {
  int64_t group, begin, length;
};

// Cuts each group's `extent(g)` units into blocks of about total/(2*workers) units (at least
// min_block), so uneven groups still spread over the workers; one block per group when serial.
template <typename Extent>
std::vector<Block> make_blocks(int64_t G, int64_t workers, int64_t min_block, Extent extent) {
  int64_t total = 0;
  for (int64_t g = 0; g < G; ++g) total += extent(g);
  const int64_t target = workers > 1 ? std::max(min_block, total / (2 * workers) + 1) : total + 1;
  std::vector<Block> blocks;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t begin = 0; begin < extent(g); begin += target) {
      blocks.push_back({g, begin, std::min(target, extent(g) - begin)});
    }
  }
  return blocks;
}

// Runs fn on every block; an exception thrown by a block (on whichever thread) is rethrown here.
void run_blocks(ParallelRunner* runner, const std::vector<Block>& blocks,
                const std::function<void(const Block&)>& fn) {
  if (runner == nullptr || blocks.size() <= 1) {
    for (const Block& b : blocks) fn(b);
    return;
  }
  std::mutex mu;
  std::string first_error;
  runner->parallel_for(static_cast<int64_t>(blocks.size()), [&](int64_t i) {
    OneDnnSingleThreaded single(true);
    try {
      fn(blocks[i]);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mu);
      if (first_error.empty()) first_error = e.what();
    }
  });
  if (!first_error.empty()) throw std::runtime_error(first_error);
}

constexpr int64_t kMinBlock = 64;  // rows (or weight-gradient rows) per oneDNN call

}  // namespace

Status grouped_matmul(const void* lhs, const void* rhs, DType in_dtype, const int32_t* group_sizes,
                      int64_t M, int64_t K, int64_t N, int64_t G, bool transpose_rhs, void* out,
                      DType out_dtype, bool checked, ParallelRunner* runner) {
  std::vector<int64_t> offsets(G + 1);
  Status status = clamp_group_offsets(group_sizes, G, M, checked, "group_sizes", offsets.data());
  if (!status.ok()) return status;
  const int64_t used_rows = offsets[G];
  // Rows that no group covers are zero; so is everything when the contraction is empty.
  zero(byte_ptr(out, used_rows * N, out_dtype), out_dtype, (M - used_rows) * N);
  if (N == 0 || used_rows == 0) return Status::Ok();
  if (K == 0) {
    zero(out, out_dtype, used_rows * N);
    return Status::Ok();
  }
  try {
    ComputeInputs in(lhs, M * K, rhs, G * K * N, in_dtype);
    ComputeOutput result(out, out_dtype, in.dtype, used_rows * N);
    const memory::data_type src_t = to_dnnl(in.dtype), dst_t = to_dnnl(result.dtype);
    const Dims wei_strides = transpose_rhs ? Dims{1, K} : Dims{N, 1};
    const auto rt = DNNL_RUNTIME_DIM_VAL;
    const dnnl::matmul matmul = make_matmul(memory::desc({rt, K}, src_t, {K, 1}),
                                            memory::desc({K, N}, src_t, wei_strides),
                                            memory::desc({rt, N}, dst_t, {N, 1}));
    const auto blocks = make_blocks(G, num_workers(runner), kMinBlock,
                                    [&](int64_t g) { return offsets[g + 1] - offsets[g]; });
    run_blocks(runner, blocks, [&](const Block& b) {
      const int64_t row = offsets[b.group] + b.begin;
      memory src({{b.length, K}, src_t, {K, 1}}, cpu_engine(), byte_ptr(in.lhs, row * K, in.dtype));
      memory wei({{K, N}, src_t, wei_strides}, cpu_engine(),
                 byte_ptr(in.rhs, b.group * K * N, in.dtype));
      memory dst({{b.length, N}, dst_t, {N, 1}}, cpu_engine(),
                 byte_ptr(result.data, row * N, result.dtype));
      dnnl::stream stream(cpu_engine());
      matmul.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
      stream.wait();
    });
    result.finish();
  } catch (const std::exception& e) {
    return Status::Error(std::string("grouped_matmul: oneDNN failed: ") + e.what());
  }
  return Status::Ok();
}

Status grouped_matmul_contract(const void* lhs, const void* rhs, DType in_dtype,
                               const int32_t* group_sizes, int64_t M, int64_t K, int64_t N,
                               int64_t G, void* out, DType out_dtype, bool checked,
                               ParallelRunner* runner) {
  std::vector<int64_t> offsets(G + 1);
  Status status = clamp_group_offsets(group_sizes, G, M, checked, "group_sizes", offsets.data());
  if (!status.ok()) return status;
  if (K == 0 || N == 0 || G == 0) return Status::Ok();
  // An expert without tokens gets a zero gradient (oneDNN would not write an empty contraction).
  for (int64_t g = 0; g < G; ++g) {
    if (offsets[g + 1] == offsets[g]) zero(byte_ptr(out, g * K * N, out_dtype), out_dtype, K * N);
  }
  try {
    ComputeInputs in(lhs, M * K, rhs, M * N, in_dtype);
    ComputeOutput result(out, out_dtype, in.dtype, G * K * N);
    const memory::data_type src_t = to_dnnl(in.dtype), dst_t = to_dnnl(result.dtype);
    const auto rt = DNNL_RUNTIME_DIM_VAL;
    // out[g][k0:k1] = lhs_g[:, k0:k1]^T @ rhs_g: lhs_g is read through transposed strides, and
    // both the block of K and the group's rows are run-time dimensions.
    const dnnl::matmul matmul = make_matmul(memory::desc({rt, rt}, src_t, {1, K}),
                                            memory::desc({rt, N}, src_t, {N, 1}),
                                            memory::desc({rt, N}, dst_t, {N, 1}));
    const auto blocks = make_blocks(G, num_workers(runner), kMinBlock, [&](int64_t g) {
      return offsets[g + 1] > offsets[g] ? K : int64_t{0};
    });
    run_blocks(runner, blocks, [&](const Block& b) {
      const int64_t rows = offsets[b.group + 1] - offsets[b.group];
      memory src({{b.length, rows}, src_t, {1, K}}, cpu_engine(),
                 byte_ptr(in.lhs, offsets[b.group] * K + b.begin, in.dtype));
      memory wei({{rows, N}, src_t, {N, 1}}, cpu_engine(),
                 byte_ptr(in.rhs, offsets[b.group] * N, in.dtype));
      memory dst({{b.length, N}, dst_t, {N, 1}}, cpu_engine(),
                 byte_ptr(result.data, (b.group * K + b.begin) * N, result.dtype));
      dnnl::stream stream(cpu_engine());
      matmul.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
      stream.wait();
    });
    result.finish();
  } catch (const std::exception& e) {
    return Status::Error(std::string("grouped_matmul_contract: oneDNN failed: ") + e.what());
  }
  return Status::Ok();
}

}  // namespace nodrop::cpu
