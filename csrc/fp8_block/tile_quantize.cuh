// The 1x128 / 128x128 FP8 block quantization of one 128x128 tile held in
// registers: scales, rowwise data, transposed columnwise data, per-tile
// column sums for a fused bias gradient.  Shared by the quantize kernels and
// the fused activation kernels (csrc/activation), so that a fused kernel
// writes exactly the bits lpmoe.group_quantize would write for the same
// (already rounded) values.
//
// Thread (c, g) of a 256-thread CTA, c = tid % 16, g = tid / 16, holds rows
// 8g .. 8g+7 x columns 8c .. 8c+7 of the tile:
//  * a 1x128 row block is spread over the 16 lanes of a half-warp, so its
//    amax is 4 shuffles;
//  * a 128x1 column block is spread over 16 row groups: shuffle across the
//    two half-warps, then 8 warps through shared memory;
//  * the transposed copy goes through a 128x128-byte shared tile; each thread
//    writes 8-byte row chunks whose position is XOR-swizzled by the column
//    group so the 16 lanes of a half-warp hit distinct banks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/cuda_utils.h"
#include "common/numerics.cuh"
#include "common/vec_io.cuh"
#include "fp8_block/fp8_block.h"
#include "grouped/row_tiles.cuh"

namespace lpmoe {
namespace fp8_block {
using grouped::kTile;
using grouped::TileInfo;
using grouped::locate_tile;
using grouped::tile_chunk_offset;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 8;     // elements per thread per row
constexpr int kRowsPerThread = 8;

// Shared scratch of one process_tile call.  The cross-warp column partials
// are dead before the transposed tile is written, so they share its bytes
// (17 KB instead of 21: the fused activation backward fits 2 CTAs per SM).
struct Smem {
  union {
    float red[kWarps][kTile];                  // cross-warp column partials
    __align__(16) uint8_t tposed[kTile * kTile];  // transposed FP8 tile
  };
  __align__(16) float col_scale[kTile];
  float tile_amax[kWarps];
};

// 1x128 row scales: after the half-warp reduction below, lane c holds the
// amax of tile row 8g + own_row(c) (each row in two lanes, c and c ^ 2); it
// computes that row's scale, and the half-warp shares the 8 scales by
// shuffles from lane_of_row(r).
__device__ __forceinline__ int own_row(int c) { return ((c >> 3) & 1) * 4 + ((c >> 2) & 1) * 2 + (c & 1); }
__device__ __forceinline__ int lane_of_row(int r) { return ((r >> 2) & 1) * 8 + ((r >> 1) & 1) * 4 + (r & 1); }

// amax of row 8g + own_row(c) of the tile over the 16 lanes of the half-warp
// (NaN ignored; max is exact, so any order gives the same bits).  16-bit
// inputs stay packed: two rows per 32-bit word, and each butterfly step
// sends away the half of the rows the partner keeps (5 shuffles for 8 rows
// instead of 32).
template <typename IType>
__device__ __forceinline__ float half_warp_row_amax(const RawVec8<IType> (&raw)[kRowsPerThread], int c) {
  if constexpr (sizeof(IType) == 2) {
    // Amaxes are non-negative and NaN-free, so abs_max2 below is a plain max.
    uint32_t q[4];  // q[k]: rows 2k (low half) and 2k + 1 (high half)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t a = 0, b = 0;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        a = abs_max2<IType>(a, word(raw[2 * k], w));
        b = abs_max2<IType>(b, word(raw[2 * k + 1], w));
      }
      q[k] = abs_max2<IType>(__byte_perm(a, b, 0x5410), __byte_perm(a, b, 0x7632));
    }
    const bool b8 = (c & 8) != 0;
    const bool b4 = (c & 4) != 0;
    uint32_t k0 = b8 ? q[2] : q[0];
    uint32_t k1 = b8 ? q[3] : q[1];
    k0 = abs_max2<IType>(k0, __shfl_xor_sync(0xffffffffu, b8 ? q[0] : q[2], 8));
    k1 = abs_max2<IType>(k1, __shfl_xor_sync(0xffffffffu, b8 ? q[1] : q[3], 8));
    uint32_t k = b4 ? k1 : k0;
    k = abs_max2<IType>(k, __shfl_xor_sync(0xffffffffu, b4 ? k0 : k1, 4));
    k = abs_max2<IType>(k, __shfl_xor_sync(0xffffffffu, k, 2));
    k = abs_max2<IType>(k, __shfl_xor_sync(0xffffffffu, k, 1));
    return half_to_float<IType>(k, (c & 1) != 0);
  } else {
    float mine = 0.0f;
    const int own = own_row(c);
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
      float a = vec8_amax<IType>(raw[r]);
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
      mine = own == r ? a : mine;
    }
    return mine;
  }
}

// 1x128 row scales of a tile held as in process_tile: my_scale is the scale
// of row 8g + own_row(c) (one IEEE division per lane), row_scale[r] that of
// each of the thread's rows (shuffles inside the half-warp).
template <typename IType, bool kE5M2>
__device__ __forceinline__ void row_scales_1x128(const QuantizeArgs& args, const RawVec8<IType> (&raw)[kRowsPerThread],
                                                 int c, int lane, float& my_scale, float (&row_scale)[kRowsPerThread]) {
  const float mine = half_warp_row_amax<IType>(raw, c);
  my_scale = compute_block_scale(mine, Fp8Traits<kE5M2>::kMax, args.pow2_scales, args.amax_epsilon,
                                 InputTraits<IType>::max_finite());
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) row_scale[r] = __shfl_sync(0xffffffffu, my_scale, (lane & 16) | lane_of_row(r));
}

// Rowwise FP8 data of thread (c, g)'s 8 rows x 8 columns (8-byte stores,
// rows past the member and columns past K skipped).
template <typename IType, bool kE5M2>
__device__ __forceinline__ void store_rowwise(const QuantizeArgs& args, const TileInfo& ti, int64_t col0,
                                              const RawVec8<IType> (&raw)[kRowsPerThread],
                                              const float (&row_scale)[kRowsPerThread], int c, int g, bool col_ok) {
  const int64_t K = args.cols;
  // This thread's first row; the next rows are K bytes further.
  uint8_t* out = static_cast<uint8_t*>(args.out_data) + (ti.row0 + g * kRowsPerThread) * K + col0 + c * kVec;
  const int rows_here = ti.rows_valid - g * kRowsPerThread;  // rows of this thread inside the member
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r, out += K) {
    const float s = row_scale[r];
    uint2 packed;
    uint16_t* h = reinterpret_cast<uint16_t*>(&packed);
#pragma unroll
    for (int e = 0; e < kVec; e += 2)
      h[e / 2] = cvt_fp8x2<kE5M2>(__fmul_rn(elem<IType>(raw[r], e), s), __fmul_rn(elem<IType>(raw[r], e + 1), s));
    if (col_ok && r < rows_here) *reinterpret_cast<uint2*>(out) = packed;
  }
}

// 1x128 row scale_inv, (bX, round_up(M_t,4)) per member; rows in
// [M_t, round_up(M_t,4)) are 0.  my_scale as from row_scales_1x128.
__device__ __forceinline__ void store_row_scales_1x128(const QuantizeArgs& args, const TileInfo& ti, int tile_x,
                                                       int bx_count, float my_scale, int c, int g) {
  const int64_t ld = round_up<int64_t>(ti.m, 4);
  float* sc = args.out_scale + bx_count * ti.pad4_start + tile_x * ld;
  if ((c & 2) == 0) {  // one of the two lanes holding row 8g + own_row(c)
    const int row = g * kRowsPerThread + own_row(c);
    const int64_t lrow = ti.local_tile * kTile + row;
    if (row < ti.rows_valid) sc[lrow] = __fdiv_rn(1.0f, my_scale);
    else if (lrow < ld) sc[lrow] = 0.0f;
  }
}

// Lane c's 8 column partials into red_row[8c .. 8c+7] as two 16-byte stores
// (8 scalar stores at a 32-byte lane stride would be 4-way bank conflicted).
__device__ __forceinline__ void store_partials(float* red_row, int c, const float (&v)[8]) {
  float4* p = reinterpret_cast<float4*>(red_row + c * 8);
  p[0] = make_float4(v[0], v[1], v[2], v[3]);
  p[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Fused bias gradient, first half: each warp's 16-row column sums of the
// tile into red[warp] (rows summed in order, then the other row group).
template <typename IType>
__device__ __forceinline__ void column_sum_partials(const RawVec8<IType> (&raw)[kRowsPerThread],
                                                    float (&red)[kWarps][kTile], int warp, int lane, int c) {
  float s[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    float acc = 0.0f;
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) acc += elem<IType>(raw[r], e);
    acc += __shfl_xor_sync(0xffffffffu, acc, 16);
    s[e] = acc;
  }
  if (lane < 16) store_partials(red[warp], c, s);
}

// Second half, after a barrier: the tile's column sums, warps added in
// order (a fixed order: bitwise reproducible), into the dbias workspace.
__device__ __forceinline__ void write_column_sums(const QuantizeArgs& args, const float (&red)[kWarps][kTile],
                                                  int64_t j, int64_t col0, int cols_valid) {
  if (threadIdx.x < kTile && threadIdx.x < cols_valid) {
    float acc = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) acc += red[w][threadIdx.x];
    args.dbias_workspace[j * args.cols + col0 + threadIdx.x] = acc;
  }
}

// Quantizes the tile `raw` (row tile j, column tile tile_x of args.cols)
// into the outputs of `args` (input pointer unused).  Contains barriers: every
// thread of the CTA must call it, and consecutive calls on one Smem must be
// separated by a __syncthreads() (the last phase reads the transposed tile
// that the next call's first phase overwrites).
template <typename IType, bool kE5M2, int kBlockDim>
__device__ __forceinline__ void process_tile(const QuantizeArgs& args, const TileInfo& ti, int64_t j, int tile_x,
                                             const RawVec8<IType> (&raw)[kRowsPerThread], Smem& sm) {
  const int64_t K = args.cols;
  const int bx_count = static_cast<int>(ceil_div<int64_t>(K, kTile));
  const int64_t col0 = static_cast<int64_t>(tile_x) * kTile;
  const int cols_valid = static_cast<int>(K - col0 < kTile ? K - col0 : kTile);
  const int c = threadIdx.x & 15;
  const int g = threadIdx.x >> 4;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const bool col_ok = c * kVec < cols_valid;  // K % 16 == 0: whole vectors only
  const float fp8_max = Fp8Traits<kE5M2>::kMax;
  const float inf_scale = InputTraits<IType>::max_finite();
  float (&red)[kWarps][kTile] = sm.red;
  float (&col_scale)[kTile] = sm.col_scale;
  float (&tile_amax_smem)[kWarps] = sm.tile_amax;
  uint8_t* tposed = sm.tposed;

  auto V = [&](int r, int e) { return elem<IType>(raw[r], e); };

  // ---- fused bias gradient: per-tile column sums (fixed order) -----------
  if (args.dbias_workspace != nullptr) {
    column_sum_partials<IType>(raw, red, warp, lane, c);
    __syncthreads();
    write_column_sums(args, red, j, col0, cols_valid);
    __syncthreads();
  }

  // ---- scales -------------------------------------------------------------
  float row_scale[kRowsPerThread];  // scale of each of this thread's rows
  float tile_scale = 1.0f;
  float my_scale = 1.0f;            // 1D: the scale of row 8g + c % 8
  if constexpr (kBlockDim == 2) {
    float a = 0.0f;
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) a = fmaxf(a, vec8_amax<IType>(raw[r]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    if (lane == 0) tile_amax_smem[warp] = a;
    __syncthreads();
    a = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) a = fmaxf(a, tile_amax_smem[w]);
    tile_scale = compute_block_scale(a, fp8_max, args.pow2_scales, args.amax_epsilon, inf_scale);
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) row_scale[r] = tile_scale;
  } else {
    if (args.out_data != nullptr) row_scales_1x128<IType, kE5M2>(args, raw, c, lane, my_scale, row_scale);
    if (args.out_col_data != nullptr) {
      float a[kVec];
      column_amax16<IType>(raw, a);
      if (lane < 16) store_partials(red[warp], c, a);
      __syncthreads();
      if (threadIdx.x < kTile) {
        float m = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) m = fmaxf(m, red[w][threadIdx.x]);
        col_scale[threadIdx.x] = compute_block_scale(m, fp8_max, args.pow2_scales, args.amax_epsilon, inf_scale);
      }
      __syncthreads();
    }
  }

  // ---- rowwise data + scales ---------------------------------------------
  if (args.out_data != nullptr) {
    store_rowwise<IType, kE5M2>(args, ti, col0, raw, row_scale, c, g, col_ok);
    if constexpr (kBlockDim == 1) {
      store_row_scales_1x128(args, ti, tile_x, bx_count, my_scale, c, g);
    } else {
      if (threadIdx.x == 0) {
        const int ld = round_up(bx_count, 4);
        float* sc = args.out_scale + ld * (ti.pad128_start / kTile) + ti.local_tile * ld;
        sc[tile_x] = __fdiv_rn(1.0f, tile_scale);
        if (tile_x == bx_count - 1)
          for (int x = bx_count; x < ld; ++x) sc[x] = 0.0f;
      }
    }
  }

  // ---- columnwise (transposed) data + scales ------------------------------
  if (args.out_col_data != nullptr) {
    // Stage FP8 bytes transposed: column (8c+e) becomes tile row, its 8
    // values for rows 8g..8g+7 one 8-byte chunk.
    float cs[kVec];  // this thread's 8 column scales: two 16-byte shared loads
    if constexpr (kBlockDim == 1) {
      *reinterpret_cast<float4*>(cs) = reinterpret_cast<const float4*>(col_scale + c * kVec)[0];
      *reinterpret_cast<float4*>(cs + 4) = reinterpret_cast<const float4*>(col_scale + c * kVec)[1];
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const int col = c * kVec + e;
      const float s = kBlockDim == 2 ? tile_scale : cs[e];
      uint2 packed;
      uint16_t* h = reinterpret_cast<uint16_t*>(&packed);
#pragma unroll
      for (int r = 0; r < kRowsPerThread; r += 2) {
        h[r / 2] = cvt_fp8x2<kE5M2>(__fmul_rn(V(r, e), s), __fmul_rn(V(r + 1, e), s));
      }
      *reinterpret_cast<uint2*>(tposed + tile_chunk_offset(col, g)) = packed;
    }
    __syncthreads();

    // Member block is (K, pitch) with pitch = round_up(M_t,128) (grouped) or
    // M (single tensor).  Padded tokens are real zeros: rows >= rows_valid
    // were loaded as 0.
    const int64_t pitch = args.pad_columnwise_tokens ? round_up<int64_t>(ti.m, kTile) : ti.m;
    const int tokens = args.pad_columnwise_tokens ? kTile : ti.rows_valid;
    uint8_t* out = static_cast<uint8_t*>(args.out_col_data) + K * ti.pad128_start +
                   ti.local_tile * kTile;  // pad128_start is 0 for a single tensor
    const bool aligned16 = (pitch % 16) == 0;
    if (aligned16 && tokens == kTile) {
      // Grouped layout (every member block padded to 128 tokens): thread t
      // stores 16 tokens (q = t % 8) of columns t / 8 + 32 i, one 16-byte
      // store each, no byte tail.
      const int q = threadIdx.x & 7;
      const int col_first = threadIdx.x >> 3;
      uint8_t* dst = out + (col0 + col_first) * pitch + q * 16;
#pragma unroll
      for (int i = 0; i < kTile * (kTile / 16) / kThreads; ++i, dst += (kThreads / 8) * pitch) {
        const int col = col_first + i * (kThreads / 8);
        uint4 val;
        *reinterpret_cast<uint2*>(&val.x) = *reinterpret_cast<const uint2*>(tposed + tile_chunk_offset(col, 2 * q));
        *reinterpret_cast<uint2*>(&val.z) = *reinterpret_cast<const uint2*>(tposed + tile_chunk_offset(col, 2 * q + 1));
        if (col < cols_valid) *reinterpret_cast<uint4*>(dst) = val;
      }
    } else {
      for (int u = threadIdx.x; u < kTile * (kTile / 16); u += kThreads) {
        const int col = u >> 3;
        const int q = u & 7;
        if (col >= cols_valid) continue;
        const int tok0 = q * 16;
        if (tok0 >= tokens) continue;
        uint4 val;
        *reinterpret_cast<uint2*>(&val.x) = *reinterpret_cast<const uint2*>(tposed + tile_chunk_offset(col, 2 * q));
        *reinterpret_cast<uint2*>(&val.z) = *reinterpret_cast<const uint2*>(tposed + tile_chunk_offset(col, 2 * q + 1));
        uint8_t* dst = out + (col0 + col) * pitch + tok0;
        if (aligned16 && tok0 + 16 <= tokens) {
          *reinterpret_cast<uint4*>(dst) = val;
        } else {
          const uint8_t* b = reinterpret_cast<const uint8_t*>(&val);
          for (int i = 0; i < 16 && tok0 + i < tokens; ++i) dst[i] = b[i];
        }
      }
    }

    if constexpr (kBlockDim == 1) {
      // (ceil(M_t/128), round_up(K,4)) per member; K % 16 == 0, so no padding.
      const int64_t ld = round_up<int64_t>(K, 4);
      float* sc = args.out_col_scale + ld * (ti.pad128_start / kTile) + ti.local_tile * ld + col0;
      if (threadIdx.x < cols_valid) sc[threadIdx.x] = __fdiv_rn(1.0f, col_scale[threadIdx.x]);
    } else {
      if (threadIdx.x == 0) {
        // (bX, round_up(ceil(M_t/128),4)) per member at bX * pad512/128.
        const int64_t tiles_m = ceil_div<int64_t>(ti.m, kTile);
        const int64_t ld = round_up<int64_t>(tiles_m, 4);
        float* sc = args.out_col_scale + bx_count * (ti.pad512_start / kTile) + tile_x * ld;
        sc[ti.local_tile] = __fdiv_rn(1.0f, tile_scale);
        if (ti.local_tile == tiles_m - 1)
          for (int64_t y = tiles_m; y < ld; ++y) sc[y] = 0.0f;
      }
    }
  }
}

}  // namespace fp8_block
}  // namespace lpmoe
