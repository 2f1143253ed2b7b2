// CUDA token permutation: a deterministic counting sort by expert, and the row movers (scatter,
// gather, row dot products) that permute and un-permute are made of. No floating-point atomics,
// and no row position ever comes from an atomic: every result is the same on every run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include <cub/block/block_scan.cuh>

#include "engine/cuda/launch_status.cuh"
#include "engine/cuda/unmapped_rows.cuh"
#include "nodrop/engine_cuda.h"

namespace nodrop::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

Status fail(const char* fn, const std::string& what) {
  return Status::Error(std::string(fn) + ": " + what);
}

// T*k as a row count: row_map holds int32 row indices, so there are at most 2^31 - 1 rows.
Status slot_count(const char* fn, int64_t T, int64_t k, int64_t* slots) {
  if (T < 0 || k < 0) {
    return fail(fn, "T = " + std::to_string(T) + " and k = " + std::to_string(k) +
                        " must not be negative");
  }
  if (T > INT32_MAX || __builtin_mul_overflow(T, k, slots) || *slots > INT32_MAX) {
    return fail(fn, "T and T*k must be below 2^31 (row_map holds int32 rows)");
  }
  return Status::Ok();
}

__device__ bool in_rows(int32_t row, int64_t rows) { return row >= 0 && row < rows; }

// ---- sort_by_expert ----------------------------------------------------------------------------
//
// Three kernels: count_tiles histograms each tile of kTile slots; scan_tiles turns the counts of
// each expert into every tile's first row inside that expert's group (and the group size);
// place_slots ranks each slot among the earlier slots of its tile with the same expert. A row is
// group start + tile start + rank, which is the (expert, token, slot) order of the CPU sort.

constexpr int kSortThreads = 256;
constexpr int kSortWarps = kSortThreads / 32;
constexpr int kSortItems = 8;  // slots per thread
constexpr int kTile = kSortThreads * kSortItems;
constexpr int kWarpSlots = kTile / kSortWarps;  // each warp owns consecutive slots of its tile
constexpr int kExpertsPerThread = kMaxExperts / kSortThreads;
constexpr int kScanThreads = 256;
constexpr int kScanItems = 4;
constexpr size_t kWorkspaceAlign = 16;
static_assert(kMaxExperts % kSortThreads == 0, "place_slots gives each thread whole experts");

int64_t tile_count(int64_t slots) { return (slots + kTile - 1) / kTile; }

// The experts of this thread's slots, 32 apart in its warp's run of the tile (so every load of
// the warp is coalesced); -1 for a slot past the end or with an out-of-range id.
__device__ void load_experts(const int32_t* __restrict__ ids, int64_t slots, int32_t E,
                             int32_t (&experts)[kSortItems]) {
  const int64_t first =
      int64_t(blockIdx.x) * kTile + (threadIdx.x / 32) * kWarpSlots + threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < kSortItems; ++j) {
    const int64_t i = first + 32 * j;
    const int32_t e = i < slots ? ids[i] : -1;
    experts[j] = static_cast<uint32_t>(e) < static_cast<uint32_t>(E) ? e : -1;
  }
}

// tile_counts[e * tiles + b] = the number of slots of tile b that chose expert e.
__global__ void __launch_bounds__(kSortThreads)
    count_tiles(const int32_t* __restrict__ ids, int64_t slots, int32_t E,
                int32_t* __restrict__ tile_counts) {
  extern __shared__ int32_t counts[];  // [E]
  for (int e = threadIdx.x; e < E; e += kSortThreads) counts[e] = 0;
  __syncthreads();
  int32_t experts[kSortItems];
  load_experts(ids, slots, E, experts);
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < kSortItems; ++j) {
    const unsigned peers = __match_any_sync(kFullMask, experts[j]);
    // One add per expert and warp: a pure count, so the order of the atomics does not matter.
    if (experts[j] >= 0 && lane == __ffs(peers) - 1) atomicAdd(&counts[experts[j]], __popc(peers));
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kSortThreads) {
    tile_counts[int64_t(e) * gridDim.x + blockIdx.x] = counts[e];
  }
}

// One block per expert: its tile counts become exclusive prefix sums in place, and the total is
// the group size.
__global__ void __launch_bounds__(kScanThreads)
    scan_tiles(int32_t* __restrict__ tile_counts, int64_t tiles,
               int32_t* __restrict__ group_sizes) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage storage;
  int32_t* counts = tile_counts + int64_t(blockIdx.x) * tiles;
  int32_t carry = 0;  // slots of this expert in the tiles already scanned
  for (int64_t begin = 0; begin < tiles; begin += kScanThreads * kScanItems) {
    const int64_t first = begin + int64_t(threadIdx.x) * kScanItems;
    int32_t items[kScanItems];
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) items[j] = first + j < tiles ? counts[first + j] : 0;
    int32_t total;
    Scan(storage).ExclusiveSum(items, items, total);
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      if (first + j < tiles) counts[first + j] = carry + items[j];
    }
    carry += total;
    __syncthreads();  // the next chunk reuses the scan storage
  }
  if (threadIdx.x == 0) group_sizes[blockIdx.x] = carry;
}

// row_map for one tile. Each warp walks its slots 32 at a time: __match_any_sync finds the lanes
// with the same expert, and a slot's rank is the number of such lanes below it plus the warp's
// running count for that expert. A prefix over the warps then gives each warp its first row.
__global__ void __launch_bounds__(kSortThreads)
    place_slots(const int32_t* __restrict__ ids, int64_t slots, int32_t E,
                const int32_t* __restrict__ tile_starts, const int32_t* __restrict__ group_sizes,
                int32_t* __restrict__ row_map) {
  using Scan = cub::BlockScan<int32_t, kSortThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  extern __shared__ int32_t warp_rows[];  // [kSortWarps][E]: a count, then the warp's first row

  // Group starts: thread x owns experts [x * kExpertsPerThread, (x + 1) * kExpertsPerThread).
  int32_t group_start[kExpertsPerThread];
#pragma unroll
  for (int j = 0; j < kExpertsPerThread; ++j) {
    const int e = threadIdx.x * kExpertsPerThread + j;
    group_start[j] = e < E ? group_sizes[e] : 0;
  }
  Scan(scan_storage).ExclusiveSum(group_start, group_start);
  for (int i = threadIdx.x; i < kSortWarps * E; i += kSortThreads) warp_rows[i] = 0;
  __syncthreads();

  int32_t experts[kSortItems], ranks[kSortItems];
  load_experts(ids, slots, E, experts);
  const int lane = threadIdx.x % 32;
  int32_t* rows = warp_rows + (threadIdx.x / 32) * E;
#pragma unroll
  for (int j = 0; j < kSortItems; ++j) {
    const int32_t e = experts[j];
    const unsigned peers = __match_any_sync(kFullMask, e);
    if (e >= 0) ranks[j] = rows[e] + __popc(peers & ((1u << lane) - 1));
    __syncwarp();  // every peer has read rows[e] before the leader bumps it
    if (e >= 0 && lane == __ffs(peers) - 1) rows[e] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();

#pragma unroll
  for (int j = 0; j < kExpertsPerThread; ++j) {
    const int e = threadIdx.x * kExpertsPerThread + j;
    if (e >= E) break;
    int32_t row = group_start[j] + tile_starts[int64_t(e) * gridDim.x + blockIdx.x];
    for (int w = 0; w < kSortWarps; ++w) {
      const int32_t count = warp_rows[w * E + e];
      warp_rows[w * E + e] = row;
      row += count;
    }
  }
  __syncthreads();

  const int64_t first = int64_t(blockIdx.x) * kTile + (threadIdx.x / 32) * kWarpSlots + lane;
#pragma unroll
  for (int j = 0; j < kSortItems; ++j) {
    const int64_t i = first + 32 * j;
    if (i < slots) row_map[i] = experts[j] >= 0 ? rows[experts[j]] + ranks[j] : -1;
  }
}

// ---- row movers --------------------------------------------------------------------------------

constexpr int kScatterThreads = 256;
// unpermute keeps kUnroll * kN float32 sums per thread (about 100 registers for bfloat16):
// smaller blocks fit more of them on an SM.
constexpr int kGatherThreads = 128;
constexpr int kUnroll = 4;  // chunks per thread of permute_rows and unpermute, loaded together
constexpr int kDotWarps = 8;

__device__ float to_float(float x) { return x; }
__device__ float to_float(__half x) { return __half2float(x); }
__device__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ T from_float(float x);
template <>
__device__ float from_float<float>(float x) { return x; }
template <>
__device__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// kN consecutive elements moved as one access: 16 bytes, or one element.
template <typename T, int kN>
struct alignas(sizeof(T) * kN) Chunk {
  T v[kN];
};

// w * x rounded to T, the CPU's arithmetic (no fused multiply-add to contract here).
template <typename T, int kN>
__device__ Chunk<T, kN> scaled(Chunk<T, kN> x, float w) {
#pragma unroll
  for (int n = 0; n < kN; ++n) x.v[n] = from_float<T>(__fmul_rn(w, to_float(x.v[n])));
  return x;
}

// dst[row_map[i]] = w[i] * src[i / k], one slot per threadIdx.y.
template <typename T, int kN>
__global__ void __launch_bounds__(kScatterThreads)
    permute_rows_kernel(const Chunk<T, kN>* __restrict__ src, const int32_t* __restrict__ row_map,
                        const float* __restrict__ weights, int64_t slots, int32_t k,
                        int64_t chunks, Chunk<T, kN>* __restrict__ dst) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (i >= slots) return;
  const int32_t row = row_map[i];
  if (!in_rows(row, slots)) return;
  const float w = weights != nullptr ? weights[i] : 1.0f;
  const Chunk<T, kN>* x = src + (i / k) * chunks;
  Chunk<T, kN>* y = dst + int64_t(row) * chunks;
  for (int64_t c0 = threadIdx.x; c0 < chunks; c0 += kUnroll * blockDim.x) {
    Chunk<T, kN> v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * blockDim.x;
      if (c < chunks) v[u] = x[c];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * blockDim.x;
      if (c < chunks) y[c] = weights != nullptr ? scaled(v[u], w) : v[u];
    }
  }
}

// dst[t] = sum over slots s, in order, of w[t*k+s] * src[row_map[t*k+s]], one token per
// threadIdx.y; each product and each sum rounded to float32 as on the CPU.
template <typename T, int kN>
__global__ void __launch_bounds__(kGatherThreads)
    unpermute_kernel(const Chunk<T, kN>* __restrict__ src, const int32_t* __restrict__ row_map,
                       const float* __restrict__ weights, int64_t tokens, int32_t k,
                       int64_t chunks, Chunk<T, kN>* __restrict__ dst) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (t >= tokens) return;
  const int64_t slots = tokens * k;
  for (int64_t c0 = threadIdx.x; c0 < chunks; c0 += kUnroll * blockDim.x) {
    float acc[kUnroll][kN] = {};
    for (int64_t i = t * k; i < (t + 1) * k; ++i) {
      const int32_t row = row_map[i];
      if (!in_rows(row, slots)) continue;
      const float w = weights != nullptr ? weights[i] : 1.0f;
      const Chunk<T, kN>* x = src + int64_t(row) * chunks;
      Chunk<T, kN> v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = c0 + u * blockDim.x;
        if (c < chunks) v[u] = x[c];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int n = 0; n < kN; ++n) {
          acc[u][n] = __fadd_rn(acc[u][n], __fmul_rn(w, to_float(v[u].v[n])));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * blockDim.x;
      if (c >= chunks) continue;
      Chunk<T, kN> out;
#pragma unroll
      for (int n = 0; n < kN; ++n) out.v[n] = from_float<T>(acc[u][n]);
      dst[t * chunks + c] = out;
    }
  }
}

// out[i] = <a[i / k], rows[row_map[i]]>, one warp per slot: each lane sums its chunks in float64,
// then a butterfly of fixed shape adds the lanes.
template <typename T, int kN>
__global__ void __launch_bounds__(32 * kDotWarps)
    row_dots_kernel(const Chunk<T, kN>* __restrict__ a, const Chunk<T, kN>* __restrict__ rows,
                    const int32_t* __restrict__ row_map, int64_t slots, int32_t k, int64_t chunks,
                    float* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * kDotWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (i >= slots) return;  // i is the same on every lane of the warp
  const int32_t row = row_map[i];
  if (!in_rows(row, slots)) {
    if (lane == 0) out[i] = 0.0f;
    return;
  }
  const Chunk<T, kN>* x = a + (i / k) * chunks;
  const Chunk<T, kN>* y = rows + int64_t(row) * chunks;
  double dot = 0.0;
#pragma unroll 4
  for (int64_t c = lane; c < chunks; c += 32) {
    const Chunk<T, kN> u = x[c], v = y[c];
#pragma unroll
    for (int n = 0; n < kN; ++n) dot = fma(double(to_float(u.v[n])), double(to_float(v.v[n])), dot);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(kFullMask, dot, offset);
  if (lane == 0) out[i] = static_cast<float>(dot);
}

// ---- dispatch ----------------------------------------------------------------------------------

template <typename Fn>
void dispatch(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: fn(float{}); break;
    case DType::kFloat16: fn(__half{}); break;
    case DType::kBFloat16: fn(__nv_bfloat16{}); break;
  }
}

bool valid_dtype(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

int64_t element_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// 16-byte chunks when every row of every buffer starts on 16 bytes, else single elements.
bool use_vectors(int64_t row_bytes, std::initializer_list<const void*> buffers) {
  if (row_bytes % 16 != 0) return false;
  for (const void* p : buffers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// Calls fn(T{}, std::integral_constant<int, kN>{}) for the dtype and chunk width.
template <typename Fn>
void dispatch_chunks(DType dtype, bool vectors, Fn&& fn) {
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (vectors) {
      fn(tag, std::integral_constant<int, 16 / int(sizeof(T))>{});
    } else {
      fn(tag, std::integral_constant<int, 1>{});
    }
  });
}

// Threads per row (x) and rows per block (y) for the row kernels: enough x threads for kUnroll
// chunks each, at least a warp, the rest of the block on more rows.
dim3 row_block(int64_t chunks, int threads) {
  int x = 32;
  while (x < threads && x * kUnroll < chunks) x *= 2;
  return dim3(x, threads / x);
}

Status check_row_args(const char* fn, DType dtype, int64_t T, int64_t k, int64_t H,
                      int64_t* slots) {
  if (!valid_dtype(dtype)) return fail(fn, "unknown dtype " + std::to_string(int(dtype)));
  if (H < 0) return fail(fn, "H = " + std::to_string(H) + " must not be negative");
  return slot_count(fn, T, k, slots);
}

}  // namespace

size_t sort_by_expert_workspace_bytes(int64_t T, int64_t k, int64_t E) {
  int64_t slots;
  if (!slot_count("", T, k, &slots).ok() || E <= 0 || E > kMaxExperts) return 0;
  const int64_t tiles = tile_count(slots);
  return tiles == 0 ? 0 : size_t(E) * size_t(tiles) * sizeof(int32_t) + kWorkspaceAlign;
}

Status sort_by_expert(const int32_t* ids, int64_t T, int64_t k, int64_t E, int32_t* row_map,
                      int32_t* group_sizes, void* workspace, size_t workspace_bytes,
                      cudaStream_t stream) {
  constexpr const char* fn = "sort_by_expert";
  int64_t slots;
  Status status = slot_count(fn, T, k, &slots);
  if (!status.ok()) return status;
  if (E < 0 || E > kMaxExperts) {
    return fail(fn, "E = " + std::to_string(E) + " is outside [0, " +
                        std::to_string(kMaxExperts) + "]");
  }
  const size_t needed = sort_by_expert_workspace_bytes(T, k, E);
  if (workspace_bytes < needed) {
    return fail(fn, "workspace has " + std::to_string(workspace_bytes) + " bytes, needs " +
                        std::to_string(needed));
  }
  if ((slots > 0 && (ids == nullptr || row_map == nullptr)) || (E > 0 && group_sizes == nullptr) ||
      (needed > 0 && workspace == nullptr)) {
    return fail(fn, "a buffer is null");
  }
  const int64_t tiles = tile_count(slots);
  const uintptr_t address = reinterpret_cast<uintptr_t>(workspace);
  int32_t* tile_counts = reinterpret_cast<int32_t*>(
      (address + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign);
  const auto experts = static_cast<int32_t>(E);
  if (tiles > 0) {
    count_tiles<<<unsigned(tiles), kSortThreads, E * sizeof(int32_t), stream>>>(
        ids, slots, experts, tile_counts);
  }
  if (E > 0) scan_tiles<<<experts, kScanThreads, 0, stream>>>(tile_counts, tiles, group_sizes);
  if (tiles > 0) {
    place_slots<<<unsigned(tiles), kSortThreads, kSortWarps * E * sizeof(int32_t), stream>>>(
        ids, slots, experts, tile_counts, group_sizes, row_map);
  }
  return launch_status(fn);
}

Status permute_rows(const void* src, DType dtype, const int32_t* row_map, const float* weights,
                    int64_t T, int64_t k, int64_t H, void* dst, cudaStream_t stream) {
  constexpr const char* fn = "permute_rows";
  int64_t slots;
  Status status = check_row_args(fn, dtype, T, k, H, &slots);
  if (!status.ok()) return status;
  if (slots == 0 || H == 0) return Status::Ok();
  if (src == nullptr || row_map == nullptr || dst == nullptr) return fail(fn, "a buffer is null");
  int sm_count = 0;
  const cudaError_t error = detail::sm_count(&sm_count);
  if (error != cudaSuccess) return fail(fn, cudaGetErrorString(error));
  const int64_t row_bytes = H * element_bytes(dtype);
  dispatch_chunks(dtype, use_vectors(row_bytes, {src, dst}), [&](auto tag, auto width) {
    using C = Chunk<decltype(tag), decltype(width)::value>;
    const int64_t chunks = row_bytes / sizeof(C);
    // Zero first: a row that is both past n and mapped (possible only for a row_map that
    // sort_by_expert did not make) then ends up written, as on the CPU.
    detail::fill_unmapped_rows<<<sm_count, detail::kFillThreads, 0, stream>>>(
        row_map, slots, chunks, C{}, static_cast<C*>(dst));
    const dim3 block = row_block(chunks, kScatterThreads);
    permute_rows_kernel<<<unsigned((slots + block.y - 1) / block.y), block, 0, stream>>>(
        static_cast<const C*>(src), row_map, weights, slots, static_cast<int32_t>(k), chunks,
        static_cast<C*>(dst));
  });
  return launch_status(fn);
}

Status unpermute(const void* src, DType dtype, const int32_t* row_map, const float* weights,
                 int64_t T, int64_t k, int64_t H, void* dst, cudaStream_t stream) {
  constexpr const char* fn = "unpermute";
  int64_t slots;
  Status status = check_row_args(fn, dtype, T, k, H, &slots);
  if (!status.ok()) return status;
  if (T == 0 || H == 0) return Status::Ok();
  if (dst == nullptr || (slots > 0 && (src == nullptr || row_map == nullptr))) {
    return fail(fn, "a buffer is null");
  }
  const int64_t row_bytes = H * element_bytes(dtype);
  dispatch_chunks(dtype, use_vectors(row_bytes, {src, dst}), [&](auto tag, auto width) {
    using C = Chunk<decltype(tag), decltype(width)::value>;
    const int64_t chunks = row_bytes / sizeof(C);
    const dim3 block = row_block(chunks, kGatherThreads);
    unpermute_kernel<<<unsigned((T + block.y - 1) / block.y), block, 0, stream>>>(
        static_cast<const C*>(src), row_map, weights, T, static_cast<int32_t>(k), chunks,
        static_cast<C*>(dst));
  });
  return launch_status(fn);
}

Status gather_row_dots(const void* a, const void* rows, DType dtype, const int32_t* row_map,
                       int64_t T, int64_t k, int64_t H, float* out, cudaStream_t stream) {
  constexpr const char* fn = "gather_row_dots";
  int64_t slots;
  Status status = check_row_args(fn, dtype, T, k, H, &slots);
  if (!status.ok()) return status;
  if (slots == 0) return Status::Ok();
  if (out == nullptr || row_map == nullptr || (H > 0 && (a == nullptr || rows == nullptr))) {
    return fail(fn, "a buffer is null");
  }
  const int64_t row_bytes = H * element_bytes(dtype);
  dispatch_chunks(dtype, use_vectors(row_bytes, {a, rows}), [&](auto tag, auto width) {
    using C = Chunk<decltype(tag), decltype(width)::value>;
    row_dots_kernel<<<unsigned((slots + kDotWarps - 1) / kDotWarps), 32 * kDotWarps, 0, stream>>>(
        static_cast<const C*>(a), static_cast<const C*>(rows), row_map, slots,
        static_cast<int32_t>(k), row_bytes / int64_t(sizeof(C)), out);
  });
  return launch_status(fn);
}

}  // namespace nodrop::cuda
