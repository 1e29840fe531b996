// The 128x1 (columnwise, transposed) half of the FP8 block 1x128
// quantization of one 128x128 tile of 16-bit values, done by each warp on its
// own columns from a copy of the tile in shared memory, with no CTA barrier
// after the copy is written.
//
// Shared layout ("swizzled tile"): two 128-row x 64-column halves of 128-byte
// rows; in row r the 16-byte chunk kc (8 values) sits at kc ^ (r % 8).
// Thread (c, g) of the register tile (tile_quantize.cuh) writes its 8 rows
// with stage_swizzled_tile: a half-warp's 16 chunks of one row land in
// distinct banks.
//
// Warp w then owns columns 16w .. 16w+15: lane (q, rho) = (lane & 1,
// lane >> 1) holds column chunk 2w + q (8 columns) of rows 8 rho .. 8 rho + 7.
//  * The column amax is a warp reduction (16 lanes share a chunk): no
//    shared-memory partials, no barrier.
//  * Each lane owns 8 consecutive tokens of 8 columns, i.e. 8 bytes of each
//    of 8 transposed rows: stored directly, no shared-memory transpose.
//  * Lane rho reads its rows starting at row rho % 8 (row 8 rho + ((i + rho)
//    & 7) at step i), so the 16 lanes of a chunk meet 8 different swizzle
//    phases and a warp's 512 bytes take the minimum 4 wavefronts; the bytes
//    are rotated back into token order before the store.
// Bits equal process_tile's: same scale math, exact NaN-ignoring max, same
// products and conversion.
#pragma once

#include <cstdint>

#include "common/numerics.cuh"
#include "common/vec_io.cuh"
#include "fp8_block/tile_quantize.cuh"

namespace lpmoe {
namespace fp8_block {

constexpr int kSwizzledHalfBytes = kTile * 128;  // 128 rows x 64 16-bit values
constexpr int kSwizzledTileBytes = 2 * kSwizzledHalfBytes;

__device__ __forceinline__ uint32_t swizzled_chunk_addr(uint32_t tile, int row, int chunk16) {
  return tile + (chunk16 >> 3) * kSwizzledHalfBytes + row * 128 + (((chunk16 & 7) ^ (row & 7)) << 4);
}

// Thread (c, g)'s 8 rows x 8 columns (16-bit values) into the swizzled tile.
template <typename IType>
__device__ __forceinline__ void stage_swizzled_tile(uint32_t tile, const RawVec8<IType> (&raw)[kRowsPerThread], int c,
                                                    int g) {
  static_assert(sizeof(IType) == 2, "the swizzled tile holds 16-bit values");
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const uint4 v = raw[r].w[0];
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(
                     swizzled_chunk_addr(tile, g * kRowsPerThread + r, c)),
                 "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  }
}

__device__ __forceinline__ uint4 load_swizzled_chunk(uint32_t tile, int row, int chunk16) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(swizzled_chunk_addr(tile, row, chunk16))
               : "memory");
  return v;
}

// 64-bit value rotated left by `bytes` bytes (0..7).
__device__ __forceinline__ uint2 rotate_bytes_left(uint2 v, int bytes) {
  if (bytes >= 4) v = make_uint2(v.y, v.x);
  const int sh = (bytes & 3) * 8;
  return make_uint2(__funnelshift_l(v.y, v.x, sh), __funnelshift_l(v.x, v.y, sh));
}

// Transposed data and 128x1 column scales of warp `warp`'s 16 columns of
// the swizzled tile at shared address `tile` (rows >= rows_valid and
// columns >= K already zero there).
template <typename IType, bool kE5M2>
__device__ __forceinline__ void quantize_columns_1x128(const QuantizeArgs& args, const TileInfo& ti, int tile_x,
                                                       uint32_t tile, int warp, int lane) {
  const int64_t K = args.cols;
  const int q = lane & 1;
  const int rho = lane >> 1;
  const int chunk = 2 * warp + q;  // 8-column chunk of the tile
  const int64_t col0 = static_cast<int64_t>(tile_x) * kTile;
  const bool col_ok = chunk * kVec < K - col0;
  const int rot = rho & 7;
  RawVec8<IType> v[kRowsPerThread];  // v[i]: row 8 rho + ((i + rot) & 7)
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) v[i].w[0] = load_swizzled_chunk(tile, kRowsPerThread * rho + ((i + rot) & 7), chunk);
  // Column amax over the 128 rows: 8 in registers (packed pairs), then the
  // 16 lanes of the chunk (lane bits 1..4).
  uint32_t m[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    m[k] = 0;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) m[k] = abs_max2<IType>(m[k], word(v[i], k));
#pragma unroll
    for (int o = 2; o < 32; o <<= 1) m[k] = abs_max2<IType>(m[k], __shfl_xor_sync(0xffffffffu, m[k], o));
  }
  // Lane (q, rho) computes the scale of column rot of the chunk (one IEEE
  // division); the chunk's lanes share the 8 scales by shuffles.  A select
  // tree picks the pair: an indexed m[] would go through local memory.
  const uint32_t lo_pair = (rot & 2) ? m[1] : m[0];
  const uint32_t hi_pair = (rot & 2) ? m[3] : m[2];
  const uint32_t mine = (rot & 4) ? hi_pair : lo_pair;
  const float my_scale = compute_block_scale(half_to_float<IType>(mine, (rot & 1) != 0), Fp8Traits<kE5M2>::kMax,
                                             args.pow2_scales, args.amax_epsilon, InputTraits<IType>::max_finite());
  float cs[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) cs[e] = __shfl_sync(0xffffffffu, my_scale, q + 2 * e);

  // Member block is (K, pitch): pitch = round_up(M_t, 128) with zero tokens
  // (grouped) or M (single tensor; the caller ensures M % 8 == 0).
  const int64_t pitch = args.pad_columnwise_tokens ? round_up<int64_t>(ti.m, kTile) : ti.m;
  const int tokens = args.pad_columnwise_tokens ? kTile : ti.rows_valid;
  uint8_t* out = static_cast<uint8_t*>(args.out_col_data) + K * ti.pad128_start + ti.local_tile * kTile +
                 (col0 + chunk * kVec) * pitch + kRowsPerThread * rho;
  const bool store = col_ok && kRowsPerThread * rho < tokens;
#pragma unroll
  for (int e = 0; e < kVec; ++e, out += pitch) {
    const float s = cs[e];
    auto pair = [&](int i) -> uint32_t {
      return cvt_fp8x2<kE5M2>(__fmul_rn(elem<IType>(v[i], e), s), __fmul_rn(elem<IType>(v[i + 1], e), s));
    };
    const uint2 packed = make_uint2(pair(0) | (pair(2) << 16), pair(4) | (pair(6) << 16));  // byte i: step i
    if (store) *reinterpret_cast<uint2*>(out) = rotate_bytes_left(packed, rot);               // byte t: token t
  }
  // (ceil(M_t/128), round_up(K,4)) per member; K % 16 == 0: no padding.
  if (rho < kVec && col_ok) {
    float* sc = args.out_col_scale + K * (ti.pad128_start / kTile) + ti.local_tile * K + col0 + chunk * kVec + rho;
    *sc = __fdiv_rn(1.0f, my_scale);
  }
}

}  // namespace fp8_block
}  // namespace lpmoe
