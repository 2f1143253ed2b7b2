// FP8 (E4M3) quantisation on the GPU, at the memory's speed: every thread reads 16-byte vectors
// and issues all of its loads before it reduces anything, and spends few instructions per element
// (the amax as packed integer maxima of |v|'s bits, two conversions per instruction): at 3 bytes
// moved per bfloat16 element, the H200's bandwidth leaves an SM only a handful of instructions
// per element.
// - quantize_fp8, blocks of 128 (the recipe's): half a warp per block, each lane 8 elements, four
//   blocks per half warp in flight; other blocks: one warp per block, lanes striding.
// - permute_rows_fp8: quantize_fp8's half warp per block, on a token's block, written to each of
//   the token's rows (bfloat16 row, codes and scale): the tokens are read once, not k times, and
//   the permuted rows are not read again to be quantised (skipping the amax where one scale is
//   given for all).
// - quantize_fp8_transposed: one thread block per 128-column tile of two consecutive 128-row
//   blocks. Each thread holds 8 rows x 8 columns of a row block's tile; column amaxes are
//   reduced across the thread block (skipped where one scale is given for all), and the
//   transposed codes pass through shared memory so that q_t is written in 256-byte runs.
// - transpose_fp8_codes: the same kernel on codes already made, moved as bytes.
// - quantize_fp8_weights(_transposed): one thread block per 128 x 128 block of an expert's
//   weight, read as quantize_fp8_transposed's tiles, one amax over the block (skipped where each
//   expert's scale is given), written in place or, staged, as 128-byte runs of the transposed
//   codes.
// All scale and round every element alike (block_scale, to_e4m3), by the hardware's float32 ->
// E4M3 conversion (nearest even, saturating), so they are bitwise the CPU engine, save one bit:
// the GPU's float32 arithmetic returns its canonical NaN, coded 0x7f, where the CPU keeps the
// sign of a negative NaN in the input (0xff; seen on an H100, 2026-12-07). Both decode to NaN.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "engine/cuda/grouped_matmul/group_scan.cuh"
#include "engine/cuda/launch_status.cuh"
#include "engine/cuda/unmapped_rows.cuh"
#include "nodrop/engine_cuda.h"

namespace nodrop::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kE4M3Max = 448.0f;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = 32 * kWarpsPerBlock;
constexpr int kBlock = static_cast<int>(kFp8Block);
constexpr int kChunk = 8;                       // elements a thread reads as one chunk
constexpr int kLanesPerBlock = kBlock / kChunk;  // 16: half a warp covers a block of a row

__device__ float to_float(float v) { return v; }
__device__ float to_float(__half v) { return __half2float(v); }
__device__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// A block's scale from its amax, as the CPU engine and nodrop.ops.fp8: times the float32
// reciprocal of 448; 1 where that is below float32's smallest normal number (a block of zeros,
// or so small that the reciprocal of its scale would overflow), NaN for a block holding a NaN
// or an inf.
__device__ float block_scale(float amax, bool finite) {
  const float s = __fmul_rn(amax, 1.0f / kE4M3Max);
  return !finite ? __int_as_float(0x7fc00000) : (s >= FLT_MIN ? s : 1.0f);
}

// The bits of |v| as float32, a key whose maximum over a block gives its amax: non-negative
// floats order as their bits, and an inf or a NaN lies at or above kInfKey, past every finite
// value, so one max finds both the amax and whether the block is finite.
constexpr uint32_t kInfKey = 0x7f800000u;
__device__ uint32_t float_key(float v) { return __float_as_uint(v) & 0x7fffffffu; }
__device__ float key_scale(uint32_t key) {
  return block_scale(__uint_as_float(key), key < kInfKey);
}

// v times the reciprocal of its block's scale in E4M3. The conversion rounds to nearest even and
// saturates: past +-448 (inf included) to +-448, NaN to NaN, as the CPU engine's clamp.
__device__ uint8_t to_e4m3(float v, float inverse) {
  return __nv_cvt_float_to_fp8(__fmul_rn(v, inverse), __NV_SATFINITE, __NV_E4M3);
}
// Two values in one conversion: a in the low byte, b in the high one.
__device__ uint32_t to_e4m3_pair(float a, float b, float inverse) {
  return __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(a, inverse), __fmul_rn(b, inverse)),
                                  __NV_SATFINITE, __NV_E4M3);
}

// Eight consecutive elements of one row, as read: one 16-byte vector (two for float32). Zero
// bits are 0.0 in every element type.
template <typename T>
struct Chunk {
  static constexpr int kVectors = kChunk * int(sizeof(T)) / 16;
  static constexpr int kWords = 4 * kVectors;
  uint4 raw[kVectors];

  __device__ void clear() {
#pragma unroll
    for (int v = 0; v < kVectors; ++v) raw[v] = make_uint4(0, 0, 0, 0);
  }
  // p aligned to 16 bytes.
  __device__ void load(const T* p) {
#pragma unroll
    for (int v = 0; v < kVectors; ++v) raw[v] = reinterpret_cast<const uint4*>(p)[v];
  }
  // The first `count` elements one by one (no alignment), the rest zero.
  __device__ void load_partial(const T* p, int count) {
    clear();
    for (int j = 0; j < count; ++j) reinterpret_cast<T*>(raw)[j] = p[j];
  }
  __device__ float operator[](int j) const { return to_float(reinterpret_cast<const T*>(raw)[j]); }
  __device__ uint32_t word(int w) const { return reinterpret_cast<const uint32_t*>(raw)[w]; }
};

// Eight consecutive codes of one row (transpose_fp8_codes): one 8-byte vector.
template <>
struct Chunk<uint8_t> {
  uint2 raw;

  __device__ void clear() { raw = make_uint2(0, 0); }
  // p aligned to 8 bytes.
  __device__ void load(const uint8_t* p) { raw = *reinterpret_cast<const uint2*>(p); }
  __device__ void load_partial(const uint8_t* p, int count) {
    clear();
    for (int j = 0; j < count; ++j) reinterpret_cast<uint8_t*>(&raw)[j] = p[j];
  }
  __device__ uint32_t code(int j) const {
    return ((j < 4 ? raw.x : raw.y) >> (8 * (j % 4))) & 0xffu;
  }
};

// The largest |v| keys of eight columns over the chunks added, kept as the chunks' words: one
// key per float32 word; for 16-bit types two 16-bit keys per word, whose maxima one packed
// instruction takes (the 16-bit formats' |v| bits order as their values too, inf and NaN
// last), so the amax costs about one instruction per element.
template <typename T>
struct ColumnKeys {
  static constexpr bool kPaired = sizeof(T) == 2;
  uint32_t word[Chunk<T>::kWords];

  __device__ ColumnKeys() {
#pragma unroll
    for (int w = 0; w < Chunk<T>::kWords; ++w) word[w] = 0;
  }
  __device__ static uint32_t combine(uint32_t a, uint32_t b) {
    return kPaired ? __vmaxu2(a, b) : max(a, b);
  }
  __device__ void add(const Chunk<T>& chunk) {
#pragma unroll
    for (int w = 0; w < Chunk<T>::kWords; ++w) {
      word[w] = combine(word[w], chunk.word(w) & (kPaired ? 0x7fff7fffu : 0x7fffffffu));
    }
  }
  // With the keys of the lane `offset` away (a butterfly step).
  __device__ void add_lane_xor(int offset) {
#pragma unroll
    for (int w = 0; w < Chunk<T>::kWords; ++w) {
      word[w] = combine(word[w], __shfl_xor_sync(kFullMask, word[w], offset));
    }
  }
  // Column j's key as float32 bits (float_key of the column's largest |v|).
  __device__ uint32_t column(int j) const {
    if constexpr (!kPaired) {
      return word[j];
    } else {
      const uint32_t bits = (word[j / 2] >> (16 * (j % 2))) & 0xffffu;
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        return bits << 16;
      } else {
        return float_key(__half2float(__ushort_as_half(static_cast<unsigned short>(bits))));
      }
    }
  }
  // The key of all eight columns.
  __device__ uint32_t all() const {
    uint32_t key = 0;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) key = max(key, column(j));
    return key;
  }
};

// Eight codes as one 8-byte word, element j in byte j, from four pairs: pair(p) holds elements
// 2p (low byte) and 2p + 1.
template <typename Pair>
__device__ uint2 pack_pairs(Pair pair) {
  return make_uint2(pair(0) | (pair(1) << 16), pair(2) | (pair(3) << 16));
}

// The largest key over a half warp (xor offsets below 16 stay inside it).
__device__ uint32_t half_warp_max(uint32_t key) {
#pragma unroll
  for (int offset = kLanesPerBlock / 2; offset > 0; offset /= 2) {
    key = max(key, __shfl_xor_sync(kFullMask, key, offset));
  }
  return key;
}

// quantize_fp8 with blocks of 128, C % 8 == 0, x 16-byte and q 8-byte aligned. Half warp h of
// warp w takes blocks 8w + 2u + h, u < kBlocksInFlight: each load instruction reads two
// neighbouring blocks, and all four loads are issued before the first reduction. kWholeRows
// (C % 128 == 0, every training shape): block i is elements 128 i to 128 i + 127 of x, found
// without the 64-bit division by blocks_per_row that otherwise costs more instructions than the
// block's quantisation.
constexpr int kBlocksInFlight = 4;
constexpr int kBlocksPerWarp = 2 * kBlocksInFlight;

template <typename T, bool kWholeRows>
__global__ void __launch_bounds__(kThreads)
quantize_fp8_rows_kernel(const T* __restrict__ x, int64_t M, int64_t C, int64_t blocks_per_row,
                         uint8_t* __restrict__ q, float* __restrict__ scale) {
  const int lane = threadIdx.x % 32, half = lane / kLanesPerBlock;
  const int column = kChunk * (lane % kLanesPerBlock);
  const int64_t warp = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int64_t blocks = M * blocks_per_row;
  Chunk<T> chunk[kBlocksInFlight];
  int64_t begin[kBlocksInFlight];
  bool mine[kBlocksInFlight];  // this lane has 8 elements of block u
#pragma unroll
  for (int u = 0; u < kBlocksInFlight; ++u) {
    const int64_t block = warp * kBlocksPerWarp + 2 * u + half;
    if constexpr (kWholeRows) {
      begin[u] = block * kBlock + column;
      mine[u] = block < blocks;
    } else {
      const int64_t row = block / blocks_per_row, b = block % blocks_per_row;
      begin[u] = row * C + b * kBlock + column;
      mine[u] = block < blocks && b * kBlock + column < C;  // C % 8 == 0: all 8 or none
    }
    if (mine[u]) chunk[u].load(x + begin[u]); else chunk[u].clear();
  }
#pragma unroll
  for (int u = 0; u < kBlocksInFlight; ++u) {
    ColumnKeys<T> keys;
    keys.add(chunk[u]);
    const float s = key_scale(half_warp_max(keys.all()));
    const int64_t block = warp * kBlocksPerWarp + 2 * u + half;
    if (block < blocks && lane % kLanesPerBlock == 0) scale[block] = s;
    const float inverse = __frcp_rn(s);
    if (mine[u]) {
      *reinterpret_cast<uint2*>(q + begin[u]) =
          pack_pairs([&](int p) {
            return to_e4m3_pair(chunk[u][2 * p], chunk[u][2 * p + 1], inverse);
          });
    }
  }
}

// Any other block size or alignment: one warp per block of a row, the lanes striding over it.
template <typename T>
__global__ void __launch_bounds__(kThreads)
quantize_fp8_any_block_kernel(const T* __restrict__ x, int64_t M, int64_t C, int64_t block,
                              int64_t blocks_per_row, uint8_t* __restrict__ q,
                              float* __restrict__ scale) {
  const int64_t warp = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32;
  if (warp >= M * blocks_per_row) return;
  const int lane = threadIdx.x % 32;
  const int64_t row = warp / blocks_per_row, b = warp % blocks_per_row;
  const int64_t begin = row * C + b * block;
  const int64_t size = min(block, C - b * block);
  uint32_t key = 0;
  for (int64_t i = lane; i < size; i += 32) key = max(key, float_key(to_float(x[begin + i])));
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    key = max(key, __shfl_xor_sync(kFullMask, key, offset));
  }
  const float s = key_scale(key);
  if (lane == 0) scale[warp] = s;
  const float inverse = __frcp_rn(s);
  for (int64_t i = lane; i < size; i += 32) q[begin + i] = to_e4m3(to_float(x[begin + i]), inverse);
}

// quantize_fp8_transposed. Thread block (x, y) owns column tile y of kRowBlocks consecutive
// 128-row blocks of the groups, x * kRowBlocks onwards (engine.h numbers them; those past the
// groups get scale 1 and zero codes). Thread t holds rows 8 * (t / 16) + i and columns
// 8 * (t % 16) + j of a row block's tile, i, j < 8: a half warp covers 8 whole rows of it.
constexpr int kRowsPerThread = 8;
constexpr int kTileColumns = kChunk * kLanesPerBlock;  // 128
constexpr int kPairs = kBlock / 16;  // 16-byte pairs of 8-byte runs in a column's 128 rows
// A column's codes of consecutive row blocks are neighbours in q_t, so the thread block writes
// kRowBlocks * 128 bytes of each column in one piece. The writes are what holds the kernel
// below a copy's bandwidth: with 128-byte pieces (one row block, 128 columns P bytes apart) it
// ran at 0.72-0.85 of a copy at the training shapes, 0.82-0.93 with the same codes written
// contiguously; 2 row blocks ran at 0.77-0.85, 4 at 0.68-0.75 (fewer, longer thread blocks)
// (2026-12-04-h200-transposed-quantiser).
constexpr int kRowBlocks = 2;
static_assert(kThreads / kLanesPerBlock * kRowsPerThread == kBlock, "a tile is 128 rows");
static_assert(kThreads == detail::kSetupThreads, "scan_groups runs on the same threads");
static_assert(kThreads % (kRowBlocks * kPairs) == 0, "whole columns per store step");
// Thread blocks resident per SM that the register budget must allow: a thread block has no load
// in flight while it reduces and writes a tile, so the others' loads must cover that time.
// Without the bound the 16-bit kernels took 108 registers a thread (two thread blocks an SM).
template <typename T>
constexpr int kTransposedBlocksPerSm = sizeof(T) == 4 ? 2 : 3;

// The thread's 8 rows (8 rg + i) of its 8 columns (c0 onwards, `columns` of them inside x) of a
// tile whose `rows` rows start at x's row `begin` (C columns); rows past the tile and columns
// past x read as zeros. kVector: C % 8 == 0 and x 16-byte aligned (8-byte for codes).
template <typename T, bool kVector>
__device__ void load_tile_rows(Chunk<T> (&chunk)[kRowsPerThread], const T* __restrict__ x,
                               int64_t begin, int rows, int64_t C, int64_t c0, int columns,
                               int rg) {
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int row = kRowsPerThread * rg + i;
    const T* p = x + (begin + row) * C + c0;
    if (row >= rows || columns == 0) {
      chunk[i].clear();
    } else if (kVector) {
      chunk[i].load(p);  // C % 8 == 0: all 8 columns
    } else {
      chunk[i].load_partial(p, columns);
    }
  }
}

// The bytes of a thread's 8-row run that lie inside a tile of `rows` rows.
__device__ uint2 rows_kept(int rg, int rows) {
  uint2 keep = make_uint2(0, 0);
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    if (kRowsPerThread * rg + i < rows) (i < 4 ? keep.x : keep.y) |= 0xffu << (8 * (i % 4));
  }
  return keep;
}

// Stages the thread's codes transposed: column 8 cg + j's 8 rows as one run of tile[column]
// (bytes outside `keep` zero), at inverse(j), its reciprocal scale. Run rg of column c is stored
// at run rg ^ (c / 8), so that both these writes (a half warp: 16 columns 8 apart, one run) and
// staged_rows' reads (8 lanes: one column's 8 16-byte pairs of runs) touch every bank once.
template <typename T, typename Inverse>
__device__ void stage_transposed(uint8_t (*tile)[kBlock], const Chunk<T> (&chunk)[kRowsPerThread],
                                 int cg, int rg, uint2 keep, Inverse inverse) {
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    const float inverse_j = inverse(j);
    const uint2 run = pack_pairs([&](int p) {
      return to_e4m3_pair(chunk[2 * p][j], chunk[2 * p + 1][j], inverse_j);
    });
    *reinterpret_cast<uint2*>(&tile[kChunk * cg + j][kRowsPerThread * (rg ^ cg)]) =
        make_uint2(run.x & keep.x, run.y & keep.y);
  }
}

// stage_transposed for codes already made (transpose_fp8_codes): column 8 cg + j's 8 rows are
// byte j of the thread's 8 chunks, moved as they are.
__device__ void stage_codes_transposed(uint8_t (*tile)[kBlock],
                                       const Chunk<uint8_t> (&chunk)[kRowsPerThread], int cg,
                                       int rg) {
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    const uint2 run = pack_pairs([&](int p) {
      return chunk[2 * p].code(j) | (chunk[2 * p + 1].code(j) << 8);
    });
    *reinterpret_cast<uint2*>(&tile[kChunk * cg + j][kRowsPerThread * (rg ^ cg)]) = run;
  }
}

// Codes of rows 16 pair to 16 pair + 15 of column c of a staged tile, in order.
__device__ uint4 staged_rows(const uint8_t (*tile)[kBlock], int c, int pair) {
  const int column_group = c / kChunk;
  const uint4 v = *reinterpret_cast<const uint4*>(&tile[c][16 * (pair ^ (column_group >> 1))]);
  return column_group & 1 ? make_uint4(v.z, v.w, v.x, v.y) : v;  // runs 2 pair + 1, 2 pair
}

template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads, kTransposedBlocksPerSm<T>)
quantize_fp8_transposed_kernel(const T* __restrict__ x, const int32_t* __restrict__ group_sizes,
                               int64_t M, int64_t C, int64_t G, int64_t P,
                               const float* __restrict__ given_scale, uint8_t* __restrict__ q_t,
                               float* __restrict__ scale_t) {
  __shared__ detail::GroupScanStorage scan_storage;
  __shared__ int64_t block_begin[kRowBlocks];
  __shared__ int block_rows[kRowBlocks];
  __shared__ alignas(16) uint32_t part_key[kWarpsPerBlock][kTileColumns];
  // Column 8 g + j's reciprocal scale at j * 16 + g: the 16 column groups' reads of one j fall
  // in 16 banks (at 8 g + j, every fourth group shared a bank).
  __shared__ float column_inverse[kTileColumns];
  // Row block r's codes, staged transposed (stage_transposed).
  __shared__ alignas(16) uint8_t codes_t[kRowBlocks][kTileColumns][kBlock];
  const int64_t b0 = int64_t(blockIdx.x) * kRowBlocks;
  const int row_blocks = int(min(int64_t(kRowBlocks), P / kBlock - b0));
  const int t = threadIdx.x, warp = t / 32;
  const int cg = t % kLanesPerBlock, rg = t / kLanesPerBlock;  // column and row group
  // Codes (transpose_fp8_codes) are moved as they are: no scales, read or written.
  constexpr bool kCodes = std::is_same_v<T, uint8_t>;
  // A given scale replaces every block's: no amax, no reduction, the same for the whole grid.
  const bool given = given_scale != nullptr;
  const float fixed = given ? *given_scale : 1.0f, fixed_inverse = __frcp_rn(fixed);

  if (t < kRowBlocks) block_begin[t] = 0, block_rows[t] = 0;  // past the groups: 0 rows
  __syncthreads();
  detail::scan_groups(group_sizes, G, M, scan_storage,
                      [&](int64_t, int64_t begin, int64_t end, int64_t first_block) {
                        const int64_t blocks = (end - begin + kBlock - 1) / kBlock;
                        for (int r = 0; r < kRowBlocks; ++r) {
                          const int64_t b = b0 + r;
                          if (b >= first_block && b < first_block + blocks) {
                            block_begin[r] = begin + (b - first_block) * kBlock;
                            block_rows[r] = int(min(int64_t(kBlock), end - block_begin[r]));
                          }
                        }
                      });
  __syncthreads();

  // One tile, unless C has more than the grid's 65535.
  for (int64_t tile = blockIdx.y; tile < (C + kTileColumns - 1) / kTileColumns;
       tile += gridDim.y) {
    const int64_t c0 = tile * kTileColumns + kChunk * cg;  // this thread's first column
    const int columns = int(max(int64_t(0), min(int64_t(kChunk), C - c0)));
    for (int r = 0; r < row_blocks; ++r) {
      const int64_t begin = block_begin[r];
      const int rows = block_rows[r];
      if (rows == 0) {
        // A row block past the groups: what the steps below give for no rows, without running
        // them (up to 32 of DeepSeek-V3 EP8's 96). rows is the same for the whole thread block,
        // so all of it skips the barriers. Its codes are written as zeros below.
        const int64_t c = tile * kTileColumns + t;
        if (!kCodes && t < kTileColumns && c < C) {
          scale_t[(b0 + r) * C + c] = given ? fixed : key_scale(0);
        }
        continue;
      }
      Chunk<T> chunk[kRowsPerThread];
      load_tile_rows<T, kVector>(chunk, x, begin, rows, C, c0, columns, rg);

      if constexpr (kCodes) {
        // Rows past the block were read as zeros: its codes there are 0, as
        // quantize_fp8_transposed's.
        stage_codes_transposed(codes_t[r], chunk, cg, rg);
      } else {
        if (given) {
          const int64_t c = tile * kTileColumns + t;
          if (t < kTileColumns && c < C) scale_t[(b0 + r) * C + c] = fixed;
        } else {
          // Column amaxes over the block's rows (rows past it were read as zeros): the thread's 8
          // rows, its warp's 16, then all 128.
          ColumnKeys<T> keys;
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) keys.add(chunk[i]);
          keys.add_lane_xor(kLanesPerBlock);
          if (t % 32 < kLanesPerBlock) {
            uint4* part = reinterpret_cast<uint4*>(&part_key[warp][kChunk * cg]);
            part[0] = make_uint4(keys.column(0), keys.column(1), keys.column(2), keys.column(3));
            part[1] = make_uint4(keys.column(4), keys.column(5), keys.column(6), keys.column(7));
          }
          __syncthreads();

          if (t < kTileColumns) {
            uint32_t key = 0;
#pragma unroll
            for (int w = 0; w < kWarpsPerBlock; ++w) key = max(key, part_key[w][t]);
            const float s = key_scale(key);
            column_inverse[(t % kChunk) * kLanesPerBlock + t / kChunk] = __frcp_rn(s);
            const int64_t c = tile * kTileColumns + t;
            if (c < C) scale_t[(b0 + r) * C + c] = s;
          }
          __syncthreads();
        }

        // Rows past the block are 0 (even where the scale is NaN). The next row block's first
        // barrier orders these reads of column_inverse before its writes.
        stage_transposed(codes_t[r], chunk, cg, rg, rows_kept(rg, rows), [&](int j) {
          return given ? fixed_inverse : column_inverse[j * kLanesPerBlock + cg];
        });
      }
    }
    __syncthreads();

    // q_t's rows: kRowBlocks * 8 lanes write one column's codes of the thread's row blocks.
    constexpr int kLanesPerColumn = kRowBlocks * kPairs;
#pragma unroll 4
    for (int u = 0; u < kTileColumns * kLanesPerColumn / kThreads; ++u) {
      const int c = u * (kThreads / kLanesPerColumn) + t / kLanesPerColumn;
      const int r = t % kLanesPerColumn / kPairs, pair = t % kPairs;
      const int64_t column = tile * kTileColumns + c;
      if (column < C && r < row_blocks) {
        const uint4 v =
            block_rows[r] > 0 ? staged_rows(codes_t[r], c, pair) : make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(q_t + column * P + (b0 + r) * kBlock + 16 * pair) = v;
      }
    }
    __syncthreads();  // the shared arrays are the next tile's
  }
}

// quantize_fp8_weights and quantize_fp8_weights_transposed: thread block (x, y, z) quantises
// the 128 x 128 block of expert z's weight at rows 128 y and columns 128 x, read as
// quantize_fp8_transposed reads a tile (thread t holds rows 8 (t / 16) + i and columns
// 8 (t % 16) + j), scaled by one amax over the whole block (or the expert's given scale).
// kTransposed: staged transposed and written as 128-byte runs, one per column (row n of expert
// z's [N, K] codes holds the block's codes at k = 128 y onwards); otherwise each thread writes
// its rows' 8 codes in place (a half warp: one row's 128). kVector: N % 8 == 0 and w 16-byte
// aligned; vector_store: K % 16 == 0 and q 16-byte aligned (transposed), N % 8 == 0 and q
// 8-byte aligned (in place).
template <typename T, bool kVector, bool kTransposed>
__global__ void __launch_bounds__(kThreads, kTransposedBlocksPerSm<T>)
quantize_fp8_weights_kernel(const T* __restrict__ w, int64_t K, int64_t N,
                            const float* __restrict__ given_scale, bool vector_store,
                            uint8_t* __restrict__ q, float* __restrict__ scale) {
  __shared__ uint32_t warp_key[kWarpsPerBlock];
  __shared__ alignas(16) uint8_t codes_t[kTransposed ? kTileColumns : 1][kBlock];
  const int64_t g = blockIdx.z, k0 = int64_t(blockIdx.y) * kBlock;
  const int64_t n0 = int64_t(blockIdx.x) * kTileColumns;
  const int t = threadIdx.x, warp = t / 32;
  const int cg = t % kLanesPerBlock, rg = t / kLanesPerBlock;  // column and row group
  const int rows = int(min(int64_t(kBlock), K - k0));
  const int64_t c0 = n0 + kChunk * cg;  // this thread's first column
  const int columns = int(max(int64_t(0), min(int64_t(kChunk), N - c0)));
  Chunk<T> chunk[kRowsPerThread];
  load_tile_rows<T, kVector>(chunk, w + g * K * N, k0, rows, N, c0, columns, rg);

  float s;
  if (given_scale != nullptr) {
    s = given_scale[g];
  } else {  // the block's amax: the thread's 64 elements, its warp's, then all eight warps'
    ColumnKeys<T> keys;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) keys.add(chunk[i]);
    uint32_t key = keys.all();
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      key = max(key, __shfl_xor_sync(kFullMask, key, offset));
    }
    if (t % 32 == 0) warp_key[warp] = key;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kWarpsPerBlock; ++i) key = max(key, warp_key[i]);
    s = key_scale(key);
  }
  const float inverse = __frcp_rn(s);

  if constexpr (!kTransposed) {
    if (t == 0) scale[(g * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] = s;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int row = kRowsPerThread * rg + i;
      if (row >= rows || columns == 0) continue;
      const uint2 codes = pack_pairs([&](int p) {
        return to_e4m3_pair(chunk[i][2 * p], chunk[i][2 * p + 1], inverse);
      });
      uint8_t* p = q + (g * K + k0 + row) * N + c0;
      if (vector_store && columns == kChunk) {
        *reinterpret_cast<uint2*>(p) = codes;
      } else {
        for (int e = 0; e < columns; ++e) {
          p[e] = static_cast<uint8_t>((e < 4 ? codes.x : codes.y) >> (8 * (e % 4)));
        }
      }
    }
  } else {
    if (t == 0) scale[(g * gridDim.x + blockIdx.x) * gridDim.y + blockIdx.y] = s;
    stage_transposed(codes_t, chunk, cg, rg, rows_kept(rg, rows), [&](int) { return inverse; });
    __syncthreads();
    // 8 lanes write one column's codes, 16 bytes each.
    uint8_t* out = q + g * N * K + k0;
#pragma unroll
    for (int u = 0; u < kTileColumns * kPairs / kThreads; ++u) {
      const int c = u * (kThreads / kPairs) + t / kPairs, pair = t % kPairs;
      const int first = 16 * pair;
      if (n0 + c >= N || first >= rows) continue;
      const uint4 v = staged_rows(codes_t, c, pair);
      uint8_t* p = out + (n0 + c) * K + first;
      if (vector_store) {  // K % 16 == 0: whole pieces
        *reinterpret_cast<uint4*>(p) = v;
      } else {
        const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&v);
        for (int b = 0; b < min(16, rows - first); ++b) p[b] = bytes[b];
      }
    }
  }
}

// permute_rows_fp8: half warp h of the grid takes 128-block h % blocks_per_row of token
// h / blocks_per_row, 8 elements a lane, reads it once, quantises it as quantize_fp8 does, and
// writes the elements, their codes and the block's scale to each of the token's k rows. kVector:
// H % 8 == 0, src and dst 16-byte and q 8-byte aligned; otherwise element by element.
template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads)
permute_rows_fp8_kernel(const T* __restrict__ src, const int32_t* __restrict__ row_map,
                        int64_t tokens, int32_t k, int64_t H, int64_t blocks_per_row,
                        const float* __restrict__ given_scale, T* __restrict__ dst,
                        uint8_t* __restrict__ q, float* __restrict__ scale) {
  const int lane = threadIdx.x % 32;
  const int64_t half_warp = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / kLanesPerBlock;
  const int64_t t = half_warp / blocks_per_row, b = half_warp % blocks_per_row;
  const int64_t column = b * kBlock + kChunk * (lane % kLanesPerBlock);
  // Lanes past the tokens or past H hold zeros: the half-warp maximum needs every lane.
  const int count = t < tokens ? int(max(int64_t(0), min(int64_t(kChunk), H - column))) : 0;
  Chunk<T> chunk;
  if (kVector && count == kChunk) chunk.load(src + t * H + column);
  else chunk.load_partial(src + t * H + column, count);
  ColumnKeys<T> keys;
  keys.add(chunk);
  // A given scale replaces the block's own: the same for every lane, so whole warps skip the
  // reduction (whose shuffles need every lane).
  const float s = given_scale != nullptr ? *given_scale : key_scale(half_warp_max(keys.all()));
  if (t >= tokens) return;
  const float inverse = __frcp_rn(s);
  const uint2 codes = pack_pairs(
      [&](int p) { return to_e4m3_pair(chunk[2 * p], chunk[2 * p + 1], inverse); });
  const int64_t slots = tokens * k;
  for (int32_t j = 0; j < k; ++j) {
    const int32_t row = row_map[t * k + j];
    if (row < 0 || row >= slots) continue;
    if (lane % kLanesPerBlock == 0) scale[row * blocks_per_row + b] = s;
    const int64_t at = row * H + column;
    if (kVector && count == kChunk) {
#pragma unroll
      for (int v = 0; v < Chunk<T>::kVectors; ++v) {
        reinterpret_cast<uint4*>(dst + at)[v] = chunk.raw[v];
      }
      *reinterpret_cast<uint2*>(q + at) = codes;
    } else {
      for (int e = 0; e < count; ++e) {
        dst[at + e] = reinterpret_cast<const T*>(chunk.raw)[e];
        q[at + e] = static_cast<uint8_t>((e < 4 ? codes.x : codes.y) >> (8 * (e % 4)));
      }
    }
  }
}

// f(static_cast<const T*>(x)) for x's element type T.
template <typename F>
void with_element_type(const void* x, DType dtype, F f) {
  switch (dtype) {
    case DType::kFloat32: f(static_cast<const float*>(x)); break;
    case DType::kFloat16: f(static_cast<const __half*>(x)); break;
    case DType::kBFloat16: f(static_cast<const __nv_bfloat16*>(x)); break;
  }
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

Status quantize_fp8(const void* x, DType dtype, int64_t M, int64_t C, int64_t block, uint8_t* q,
                    float* scale, cudaStream_t stream) {
  auto fail = [](const std::string& what) { return Status::Error("quantize_fp8: " + what); };
  if (M < 0 || C < 0) return fail("negative shape");
  if (block < 1) return fail("block must be at least 1, got " + std::to_string(block));
  const int64_t blocks_per_row = (C + block - 1) / block;
  const int64_t blocks = M * blocks_per_row;
  if (blocks == 0) return Status::Ok();
  if (x == nullptr || q == nullptr || scale == nullptr) return fail("a buffer is null");
  const bool vector = block == kBlock && C % kChunk == 0 && aligned(x, 16) && aligned(q, 8);
  with_element_type(x, dtype, [&](auto typed_x) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed_x)>>;
    if (vector) {
      const int64_t per_thread_block = int64_t(kBlocksPerWarp) * kWarpsPerBlock;
      const unsigned grid = unsigned((blocks + per_thread_block - 1) / per_thread_block);
      auto kernel = C % kBlock == 0 ? quantize_fp8_rows_kernel<T, true>
                                    : quantize_fp8_rows_kernel<T, false>;
      kernel<<<grid, kThreads, 0, stream>>>(typed_x, M, C, blocks_per_row, q, scale);
    } else {
      const unsigned grid = unsigned((blocks + kWarpsPerBlock - 1) / kWarpsPerBlock);
      quantize_fp8_any_block_kernel<T>
          <<<grid, kThreads, 0, stream>>>(typed_x, M, C, block, blocks_per_row, q, scale);
    }
  });
  return launch_status("quantize_fp8");
}

Status permute_rows_fp8(const void* src, DType dtype, const int32_t* row_map, int64_t T,
                        int64_t k, int64_t H, const float* given_scale, void* dst,
                        uint8_t* q, float* scale, cudaStream_t stream) {
  auto fail = [](const std::string& what) { return Status::Error("permute_rows_fp8: " + what); };
  if (T < 0 || k < 0 || H < 0) {
    return fail("T, k and H must not be negative, got T = " + std::to_string(T) + ", k = " +
                std::to_string(k) + ", H = " + std::to_string(H));
  }
  if (dtype != DType::kFloat32 && dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    return fail("unknown dtype " + std::to_string(int(dtype)));
  }
  int64_t slots;
  if (T > INT32_MAX || __builtin_mul_overflow(T, k, &slots) || slots > INT32_MAX) {
    return fail("T and T*k must be below 2^31 (row_map holds int32 rows)");
  }
  const int64_t blocks_per_row = (H + kBlock - 1) / kBlock;
  if (slots == 0 || H == 0) return Status::Ok();
  if (src == nullptr || row_map == nullptr || dst == nullptr || q == nullptr ||
      scale == nullptr) {
    return fail("a buffer is null");
  }
  int sm_count = 0;
  const cudaError_t error = detail::sm_count(&sm_count);
  if (error != cudaSuccess) return fail(cudaGetErrorString(error));
  const bool vector = H % kChunk == 0 && aligned(src, 16) && aligned(dst, 16) && aligned(q, 8);
  with_element_type(src, dtype, [&](auto typed_src) {
    using T_ = std::remove_const_t<std::remove_pointer_t<decltype(typed_src)>>;
    T_* typed_dst = static_cast<T_*>(dst);
    // Rows no slot maps to read as a zero row's quantisation (scale 1, or the given one); filled
    // first, as permute_rows.
    detail::fill_unmapped_rows<<<sm_count, detail::kFillThreads, 0, stream>>>(
        row_map, slots, H, T_{}, typed_dst);
    detail::fill_unmapped_rows<<<sm_count, detail::kFillThreads, 0, stream>>>(
        row_map, slots, H, uint8_t{0}, q);
    detail::fill_unmapped_rows<<<sm_count, detail::kFillThreads, 0, stream>>>(
        row_map, slots, blocks_per_row, 1.0f, scale, given_scale);
    const int64_t threads = T * blocks_per_row * kLanesPerBlock;
    const unsigned grid = unsigned((threads + kThreads - 1) / kThreads);
    auto kernel = vector ? permute_rows_fp8_kernel<T_, true> : permute_rows_fp8_kernel<T_, false>;
    kernel<<<grid, kThreads, 0, stream>>>(typed_src, row_map, T, static_cast<int32_t>(k), H,
                                          blocks_per_row, given_scale, typed_dst, q, scale);
  });
  return launch_status("permute_rows_fp8");
}

namespace {

// quantize_fp8_transposed_kernel<T> on x [M, C], for `fn`: T a float type (quantize_fp8_transposed)
// or uint8_t codes (transpose_fp8_codes, which has no scales); x_name names x in its errors.
template <typename T>
Status launch_transposed(const char* fn, const char* x_name, const T* x,
                         const int32_t* group_sizes, int64_t M, int64_t C, int64_t G,
                         const float* given_scale, uint8_t* q_t, float* scale,
                         cudaStream_t stream) {
  constexpr bool kCodes = std::is_same_v<T, uint8_t>;
  auto fail = [fn](const std::string& what) {
    return Status::Error(std::string(fn) + ": " + what);
  };
  if (M < 0 || C < 0 || G < 0) {
    return fail("M, C and G must not be negative, got M = " + std::to_string(M) + ", C = " +
                std::to_string(C) + ", G = " + std::to_string(G));
  }
  const int64_t PB = fp8_contract_blocks(M, G), P = PB * kFp8Block;
  if (PB == 0 || C == 0) return Status::Ok();
  if (q_t == nullptr) return fail(kCodes ? "q_t is null" : "q_t or scale is null");
  if (!kCodes && scale == nullptr) return fail("q_t or scale is null");
  if (M > 0 && x == nullptr) return fail(std::string(x_name) + " is null");
  if (G > 0 && group_sizes == nullptr) return fail("group_sizes is null");
  if (!aligned(q_t, 16)) return fail("q_t must be 16-byte aligned");
  if (PB > INT32_MAX) return fail("too large: " + std::to_string(PB) + " row blocks");
  const int64_t tiles = (C + kTileColumns - 1) / kTileColumns;
  const dim3 grid{static_cast<unsigned>((PB + kRowBlocks - 1) / kRowBlocks),
                  static_cast<unsigned>(min(tiles, int64_t(65535)))};
  // The vector path reads a thread's 8 elements of a row as one piece: 16 bytes, 8 of codes.
  const bool vector = C % kChunk == 0 && aligned(x, kCodes ? 8 : 16);
  auto kernel =
      vector ? quantize_fp8_transposed_kernel<T, true> : quantize_fp8_transposed_kernel<T, false>;
  kernel<<<grid, kThreads, 0, stream>>>(x, group_sizes, M, C, G, P, given_scale, q_t, scale);
  return launch_status(fn);
}

}  // namespace

Status quantize_fp8_transposed(const void* x, DType dtype, const int32_t* group_sizes, int64_t M,
                               int64_t C, int64_t G, const float* given_scale, uint8_t* q_t,
                               float* scale, cudaStream_t stream) {
  if (dtype != DType::kFloat32 && dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    return Status::Error("quantize_fp8_transposed: unknown dtype " + std::to_string(int(dtype)));
  }
  Status status = Status::Ok();
  with_element_type(x, dtype, [&](auto typed_x) {
    status = launch_transposed("quantize_fp8_transposed", "x", typed_x, group_sizes, M, C, G,
                               given_scale, q_t, scale, stream);
  });
  return status;
}

Status transpose_fp8_codes(const uint8_t* q, const int32_t* group_sizes, int64_t M, int64_t C,
                           int64_t G, uint8_t* q_t, cudaStream_t stream) {
  return launch_transposed("transpose_fp8_codes", "q", q, group_sizes, M, C, G, nullptr, q_t,
                           nullptr, stream);
}

namespace {

// quantize_fp8_weights (kTransposed false) or quantize_fp8_weights_transposed.
template <bool kTransposed>
Status quantize_weight_blocks(const char* function, const void* w, DType dtype, int64_t G,
                              int64_t K, int64_t N, const float* given_scale, uint8_t* q,
                              float* scale, cudaStream_t stream) {
  auto fail = [&](const std::string& what) { return Status::Error(function + (": " + what)); };
  if (G < 0 || K < 0 || N < 0) {
    return fail("G, K and N must not be negative, got G = " + std::to_string(G) + ", K = " +
                std::to_string(K) + ", N = " + std::to_string(N));
  }
  if (G == 0 || K == 0 || N == 0) return Status::Ok();
  if (w == nullptr || q == nullptr || scale == nullptr) return fail("a buffer is null");
  const int64_t KB = (K + kBlock - 1) / kBlock, NB = (N + kBlock - 1) / kBlock;
  if (G > 65535 || KB > 65535 || NB > INT32_MAX) {
    return fail("too large: G = " + std::to_string(G) + " and ceil(K / 128) = " +
                std::to_string(KB) + " must be at most 65535, ceil(N / 128) = " +
                std::to_string(NB) + " below 2^31");
  }
  const dim3 grid{static_cast<unsigned>(NB), static_cast<unsigned>(KB),
                  static_cast<unsigned>(G)};
  const bool vector_load = N % kChunk == 0 && aligned(w, 16);
  const bool vector_store =
      kTransposed ? K % 16 == 0 && aligned(q, 16) : N % kChunk == 0 && aligned(q, 8);
  with_element_type(w, dtype, [&](auto typed_w) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed_w)>>;
    auto kernel = vector_load ? quantize_fp8_weights_kernel<T, true, kTransposed>
                              : quantize_fp8_weights_kernel<T, false, kTransposed>;
    kernel<<<grid, kThreads, 0, stream>>>(typed_w, K, N, given_scale, vector_store, q, scale);
  });
  return launch_status(function);
}

}  // namespace

Status quantize_fp8_weights(const void* w, DType dtype, int64_t G, int64_t K, int64_t N,
                            const float* given_scale, uint8_t* q, float* scale,
                            cudaStream_t stream) {
  return quantize_weight_blocks<false>("quantize_fp8_weights", w, dtype, G, K, N, given_scale, q,
                                       scale, stream);
}

Status quantize_fp8_weights_transposed(const void* w, DType dtype, int64_t G, int64_t K,
                                       int64_t N, const float* given_scale, uint8_t* q_t,
                                       float* scale, cudaStream_t stream) {
  return quantize_weight_blocks<true>("quantize_fp8_weights_transposed", w, dtype, G, K, N,
                                      given_scale, q_t, scale, stream);
}

}  // namespace nodrop::cuda
