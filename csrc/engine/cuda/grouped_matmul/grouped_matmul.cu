// CUDA grouped matmul: argument checks, workspace layout, and the two launches of a call (the
// setup kernel, which builds the group table and zeroes what no tile writes, then the CUTLASS
// grouped GEMM), all on the caller's stream.
#include <atomic>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <string>
#include <utility>

#include "engine/cuda/grouped_matmul/group_table.cuh"
#include "engine/cuda/grouped_matmul/setup_kernel.cuh"
#include "nodrop/engine_cuda.h"

namespace nodrop::cuda {
namespace {

using detail::GemmForm;
using detail::GroupShape;
using detail::GroupTable;

constexpr size_t kAlignment = 128;  // of every workspace array; TMA descriptors need 64
constexpr int kMaxSmCount = 256;    // the GEMM workspace is sized for this many SMs
// Per SM, CUTLASS keeps its own copy of each TMA descriptor it patches per group: A and B for
// the mainloop, D for each of the two consumer warpgroups' epilogues.
constexpr size_t kTensorMapBytes = 128;
constexpr size_t kTensorMapsPerSm = 4;
constexpr size_t kGemmWorkspaceBytes = kMaxSmCount * kTensorMapsPerSm * kTensorMapBytes;

size_t round_up(size_t value, size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Byte offsets of the workspace arrays from the aligned workspace start.
struct WorkspaceLayout {
  size_t offsets, shapes, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, gemm;
  size_t bytes;  // including the slack for aligning an unaligned workspace pointer
};

WorkspaceLayout workspace_layout(int64_t G) {
  const size_t groups = G > 0 ? static_cast<size_t>(G) : 0;
  size_t end = 0;
  auto take = [&end](size_t bytes) {
    const size_t start = end;
    end = round_up(end + bytes, kAlignment);
    return start;
  };
  WorkspaceLayout layout;
  layout.offsets = take((groups + 1) * sizeof(int64_t));
  layout.shapes = take(groups * sizeof(GroupShape));
  layout.ptr_a = take(groups * sizeof(void*));
  layout.ptr_b = take(groups * sizeof(void*));
  layout.ptr_d = take(groups * sizeof(void*));
  layout.stride_a = take(groups * sizeof(detail::StrideKMajor));
  layout.stride_b = take(groups * sizeof(detail::StrideKMajor));
  layout.stride_d = take(groups * sizeof(detail::StrideKMajor));
  layout.gemm = take(kGemmWorkspaceBytes);
  layout.bytes = end + kAlignment;
  return layout;
}
static_assert(sizeof(detail::StrideKMajor) == sizeof(detail::StrideMNMajor));

// The device a call runs on (current_device).
struct Device {
  int id = 0, sm_count = 0, l2_bytes = 0;
  int64_t memory_bandwidth = 0;
};

// The table of one call; `schedule` is resolved (no kAuto).
GroupTable make_table(void* workspace, int64_t G, const Device& device,
                      const GemmSchedule& schedule) {
  const WorkspaceLayout layout = workspace_layout(G);
  char* base =
      reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(workspace), kAlignment));
  GroupTable table;
  table.num_groups = static_cast<int32_t>(G);
  table.offsets = reinterpret_cast<int64_t*>(base + layout.offsets);
  table.shapes = reinterpret_cast<GroupShape*>(base + layout.shapes);
  table.ptr_a = reinterpret_cast<const void**>(base + layout.ptr_a);
  table.ptr_b = reinterpret_cast<const void**>(base + layout.ptr_b);
  table.ptr_d = reinterpret_cast<void**>(base + layout.ptr_d);
  table.stride_a = base + layout.stride_a;
  table.stride_b = base + layout.stride_b;
  table.stride_d = base + layout.stride_d;
  table.gemm_workspace = base + layout.gemm;
  table.gemm_workspace_bytes = kGemmWorkspaceBytes;
  table.device = device.id;
  table.sm_count = device.sm_count < kMaxSmCount ? device.sm_count : kMaxSmCount;
  table.raster = schedule.raster;
  table.swizzle = schedule.swizzle;
  return table;
}

// Elements of a [dims...] tensor, or -1 past 2^60, so that byte counts cannot overflow either.
int64_t elements(std::initializer_list<int64_t> dims) {
  constexpr int64_t kLimit = int64_t{1} << 60;
  int64_t count = 1;
  for (int64_t dim : dims) {
    if (__builtin_mul_overflow(count, dim, &count) || count > kLimit) return -1;
  }
  return count;
}

// A device buffer argument: its name, pointer and element count.
struct Buffer {
  const char* name;
  const void* data;
  int64_t elements;
};

// An error of entry point `fn`.
Status fail(const char* fn, const std::string& what) {
  return Status::Error(std::string(fn) + ": " + what);
}

// The checks of dtypes and dims that both entry points share; they run before check_buffers,
// whose element counts are products of the dims.
Status check_arguments(const char* fn, DType in_dtype, DType out_dtype, int64_t M, int64_t K,
                       int64_t N, int64_t G) {
  if (in_dtype != DType::kBFloat16 && in_dtype != DType::kFloat16) {
    return fail(fn, std::string("in_dtype ") + dtype_name(in_dtype) +
                        " is not supported by the CUDA engine (bfloat16 or float16)");
  }
  if (out_dtype != in_dtype && out_dtype != DType::kFloat32) {
    return fail(fn, std::string("out_dtype ") + dtype_name(out_dtype) + " must be the input dtype (" +
                        dtype_name(in_dtype) + ") or float32");
  }
  const std::pair<const char*, int64_t> dims[] = {{"M", M}, {"K", K}, {"N", N}, {"G", G}};
  for (const auto& [name, value] : dims) {
    if (value < 0 || value > INT32_MAX) {  // CUTLASS's problem shapes are int
      return fail(fn, std::string(name) + " = " + std::to_string(value) + " is outside [0, 2^31)");
    }
  }
  for (const auto& [name, value] : {dims[1], dims[2]}) {
    if (value % 8 != 0) {
      return fail(fn, std::string(name) + " = " + std::to_string(value) +
                          " must be a multiple of 8 (TMA moves 16-byte rows): pad it");
    }
  }
  return Status::Ok();
}

Status check_schedule(const char* fn, const GemmSchedule& schedule) {
  const auto tile = static_cast<int32_t>(schedule.tile);
  if (tile < 0 || tile > static_cast<int32_t>(std::size(kGemmTiles))) {
    return fail(fn, "schedule.tile = " + std::to_string(tile) + " is not a GemmTile");
  }
  const auto raster = static_cast<int32_t>(schedule.raster);
  if (raster < 0 || raster > static_cast<int32_t>(GemmRaster::kAlongN)) {
    return fail(fn, "schedule.raster = " + std::to_string(raster) + " is not a GemmRaster");
  }
  const int swizzle = schedule.swizzle;
  if (swizzle != 1 && swizzle != 2 && swizzle != 4 && swizzle != 8) {
    return fail(fn, "schedule.swizzle = " + std::to_string(swizzle) + " must be 1, 2, 4 or 8");
  }
  return Status::Ok();
}

Status check_buffers(const char* fn, std::initializer_list<Buffer> buffers,
                     const int32_t* group_sizes, int64_t G, const void* workspace,
                     size_t workspace_bytes) {
  for (const Buffer& buffer : buffers) {
    if (buffer.elements < 0) return fail(fn, std::string(buffer.name) + " has over 2^60 elements");
    if (buffer.elements == 0) continue;
    if (buffer.data == nullptr) return fail(fn, std::string(buffer.name) + " is null");
    if (reinterpret_cast<uintptr_t>(buffer.data) % 16 != 0) {
      return fail(fn, std::string(buffer.name) + " must be 16-byte aligned for TMA");
    }
  }
  if (G > 0 && group_sizes == nullptr) return fail(fn, "group_sizes is null");
  const size_t needed = grouped_matmul_workspace_bytes(G);
  if (workspace == nullptr || workspace_bytes < needed) {
    return fail(fn, "workspace has " + std::to_string(workspace_bytes) + " bytes, needs " +
                        std::to_string(needed) + " (grouped_matmul_workspace_bytes)");
  }
  return Status::Ok();
}

Status cuda_status(const char* fn, const char* step, cudaError_t error) {
  if (error == cudaSuccess) return Status::Ok();
  return fail(fn, std::string(step) + ": " + cudaGetErrorString(error));
}

// The current device, its SM count, L2 bytes and memory bandwidth (host queries; nothing waits
// on the GPU).
Status current_device(const char* fn, Device* device) {
  Status status = cuda_status(fn, "cudaGetDevice", cudaGetDevice(&device->id));
  if (status.ok()) {
    status = cuda_status(fn, "cudaDeviceGetAttribute",
                         cudaDeviceGetAttribute(&device->sm_count,
                                                cudaDevAttrMultiProcessorCount, device->id));
  }
  if (status.ok()) {
    status = cuda_status(
        fn, "cudaDeviceGetAttribute",
        cudaDeviceGetAttribute(&device->l2_bytes, cudaDevAttrL2CacheSize, device->id));
  }
  if (status.ok()) device->memory_bandwidth = memory_bandwidth(device->id);
  return status;
}

// The schedule of one call with kAuto resolved (engine_cuda.h says how).
GemmSchedule resolve_schedule(GemmSchedule schedule, int64_t M, int64_t K, int64_t N, int64_t G,
                              bool contract, int64_t in_bytes, const Device& device) {
  if (schedule.tile == GemmTile::kAuto) {
    schedule.tile = grouped_matmul_tile(M, K, N, G, contract, device.memory_bandwidth);
  }
  if (schedule.raster == GemmRaster::kAuto) {
    schedule.raster = grouped_matmul_raster(M, K, N, G, contract, in_bytes, device.l2_bytes);
  }
  return schedule;
}

// ---- dispatch to the explicit instantiations ---------------------------------------------------

template <GemmForm F, DType In, DType Out>
Status run_tile(GemmTile tile, const GroupTable& table, cudaStream_t stream) {
  switch (tile) {
#define NODROP_GEMM_TILE(name, ...) \
  case GemmTile::name: return detail::run_grouped_gemm<F, In, Out, GemmTile::name>(table, stream);
#include "engine/cuda/grouped_matmul/tiles.def"
#undef NODROP_GEMM_TILE
    case GemmTile::kAuto: break;  // resolved by the caller
  }
  return Status::Error("grouped GEMM: no kernel for tile " +
                       std::to_string(static_cast<int32_t>(tile)));
}

template <GemmForm F, DType In>
Status run_output(DType out_dtype, GemmTile tile, const GroupTable& table, cudaStream_t stream) {
  if (out_dtype == DType::kFloat32) return run_tile<F, In, DType::kFloat32>(tile, table, stream);
  return run_tile<F, In, In>(tile, table, stream);
}

template <GemmForm F>
Status run_input(DType in_dtype, DType out_dtype, GemmTile tile, const GroupTable& table,
                 cudaStream_t stream) {
  if (in_dtype == DType::kFloat16) {
    return run_output<F, DType::kFloat16>(out_dtype, tile, table, stream);
  }
  return run_output<F, DType::kBFloat16>(out_dtype, tile, table, stream);
}

Status run_gemm(GemmForm form, DType in_dtype, DType out_dtype, GemmTile tile,
                const GroupTable& table, cudaStream_t stream) {
  switch (form) {
    case GemmForm::kRows:
      return run_input<GemmForm::kRows>(in_dtype, out_dtype, tile, table, stream);
    case GemmForm::kRowsTransposed:
      return run_input<GemmForm::kRowsTransposed>(in_dtype, out_dtype, tile, table, stream);
    case GemmForm::kContract:
      return run_input<GemmForm::kContract>(in_dtype, out_dtype, tile, table, stream);
  }
  return Status::Error("grouped GEMM: unknown form");
}

}  // namespace

// The memory clock is not among the attributes the runtime keeps: each query asks the driver.
// With it asked on every call, an H100 timed each small bf16 grouped GEMM at 0.75-0.88 ms against
// 0.20-0.44 ms before the query was added, while the FP8 GEMMs, which do not ask, kept their
// times (bench/results/2026-12-07-fp8-relaid-codes/). A device's bandwidth does not change: it
// is asked once per device and kept (0 also for a failed query, whose error is cleared then).
int64_t memory_bandwidth(int device) {
  constexpr int kDevices = 64;
  static std::atomic<int64_t> known[kDevices] = {};  // bandwidth + 1; 0: not asked yet
  const bool kept = device >= 0 && device < kDevices;
  if (kept) {
    const int64_t value = known[device].load(std::memory_order_relaxed);
    if (value > 0) return value - 1;
  }
  int clock_khz = 0, bus_bits = 0;
  int64_t bandwidth = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess) {
    cudaGetLastError();  // a failed query must not surface as a later launch's error
  } else {
    bandwidth = int64_t{2} * clock_khz * 1000 * (bus_bits / 8);  // double data rate
  }
  if (kept) known[device].store(bandwidth + 1, std::memory_order_relaxed);
  return bandwidth;
}

size_t grouped_matmul_workspace_bytes(int64_t G) { return workspace_layout(G).bytes; }

Status grouped_matmul(const void* lhs, const void* rhs, DType in_dtype, const int32_t* group_sizes,
                      int64_t M, int64_t K, int64_t N, int64_t G, bool transpose_rhs, void* out,
                      DType out_dtype, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                      GemmSchedule schedule) {
  constexpr const char* fn = "grouped_matmul";
  Status status = check_arguments(fn, in_dtype, out_dtype, M, K, N, G);
  if (status.ok()) status = check_schedule(fn, schedule);
  if (!status.ok()) return status;
  status = check_buffers(fn,
                         {{"lhs", lhs, elements({M, K})},
                          {"rhs", rhs, elements({G, K, N})},
                          {"out", out, elements({M, N})}},
                         group_sizes, G, workspace, workspace_bytes);
  if (!status.ok()) return status;
  const int64_t row_bytes = N * dtype_size(out_dtype);
  if (M == 0 || N == 0) return Status::Ok();
  if (K == 0 || G == 0) {  // nothing to contract, or no group owns a row
    return cuda_status(fn, "cudaMemsetAsync", cudaMemsetAsync(out, 0, M * row_bytes, stream));
  }
  Device device;
  status = current_device(fn, &device);
  if (!status.ok()) return status;
  schedule = resolve_schedule(schedule, M, K, N, G, /*contract=*/false, dtype_size(in_dtype),
                              device);
  const GroupTable table = make_table(workspace, G, device, schedule);
  const GemmForm form = transpose_rhs ? GemmForm::kRowsTransposed : GemmForm::kRows;
  const detail::Operands ops{lhs, rhs, out, dtype_size(in_dtype), dtype_size(out_dtype)};
  status = cuda_status(
      fn, "setup kernel",
      detail::launch_prepare_grouped_gemm(form, group_sizes, M, K, N, ops, table, stream));
  if (!status.ok()) return status;
  return run_gemm(form, in_dtype, out_dtype, schedule.tile, table, stream);
}

Status grouped_matmul_contract(const void* lhs, const void* rhs, DType in_dtype,
                               const int32_t* group_sizes, int64_t M, int64_t K, int64_t N,
                               int64_t G, void* out, DType out_dtype, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream,
                               GemmSchedule schedule) {
  constexpr const char* fn = "grouped_matmul_contract";
  Status status = check_arguments(fn, in_dtype, out_dtype, M, K, N, G);
  if (status.ok()) status = check_schedule(fn, schedule);
  if (!status.ok()) return status;
  status = check_buffers(fn,
                         {{"lhs", lhs, elements({M, K})},
                          {"rhs", rhs, elements({M, N})},
                          {"out", out, elements({G, K, N})}},
                         group_sizes, G, workspace, workspace_bytes);
  if (!status.ok()) return status;
  const int64_t group_bytes = K * N * dtype_size(out_dtype);
  if (G == 0 || group_bytes == 0) return Status::Ok();
  if (M == 0) {  // every group is empty
    return cuda_status(fn, "cudaMemsetAsync", cudaMemsetAsync(out, 0, G * group_bytes, stream));
  }
  Device device;
  status = current_device(fn, &device);
  if (!status.ok()) return status;
  schedule = resolve_schedule(schedule, M, K, N, G, /*contract=*/true, dtype_size(in_dtype),
                              device);
  const GroupTable table = make_table(workspace, G, device, schedule);
  const detail::Operands ops{lhs, rhs, out, dtype_size(in_dtype), dtype_size(out_dtype)};
  status = cuda_status(fn, "setup kernel",
                       detail::launch_prepare_grouped_gemm(GemmForm::kContract, group_sizes, M, K,
                                                           N, ops, table, stream));
  if (!status.ok()) return status;
  return run_gemm(GemmForm::kContract, in_dtype, out_dtype, schedule.tile, table, stream);
}

}  // namespace nodrop::cuda
