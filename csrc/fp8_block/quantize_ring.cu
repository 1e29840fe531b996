// FP8 block 1x128 quantize of 16-bit inputs on the TMA tile ring
// (grouped/tile_ring.cuh): a producer warp loads each 128x128 input tile as
// two 128-row x 64-column boxes with 128-byte swizzle; each of the eight
// consumer warps then reads the tile twice from shared memory, in the two
// layouts its two outputs want, and needs no CTA barrier:
//  * rows 16w .. 16w+15, thread (c, g) holding 8 rows x 8 columns exactly as
//    process_tile does (tile_quantize.cuh's row helpers, so the rowwise bits
//    are the same code);
//  * columns 16w .. 16w+15 for the transposed copy: lane (q, rho) holds
//    column chunk 2w + q (8 columns) of rows 8 rho .. 8 rho + 7.  The 128x1
//    column amax is a warp reduction (16 lanes share a chunk), and each lane
//    owns 8 consecutive tokens of 8 columns, i.e. 8 bytes of each of 8
//    transposed rows: stored directly, no shared-memory transpose.
// Bank conflicts: lane rho reads its 8 rows starting at row rho % 8 (row
// 8 rho + ((i + rho) & 7) at step i), so the 16 lanes of a chunk hit 8
// different swizzle phases and a warp's 512 bytes take the minimum 4
// wavefronts; the bytes of the transposed chunk are rotated back into token
// order before the store.  Bits equal the register-tile kernels' (same
// scale math, NaN-ignoring exact max, same conversion).
#include "fp8_block/quantize_ring.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/cuda_utils.h"
#include "common/persistent_grid.h"
#include "common/tensor_map.h"
#include "cute/arch/copy_sm90_tma.hpp"
#include "fp8_block/tile_quantize.cuh"
#include "grouped/tile_ring.cuh"

namespace lpmoe {
namespace fp8_block {
namespace {

using grouped::RingSlot;
using grouped::RingTiles;

constexpr int kBoxCols = 64;                   // 128 bytes of 16-bit values
constexpr int kHalfBytes = kTile * kBoxCols * 2;  // one box: 128 rows x 128 bytes
constexpr int kStageBytes = 2 * kHalfBytes;
constexpr int kStages = 3;                     // 2 CTAs x 3 stages x 32 KB per SM

// 16-byte chunk kc (0..7) of `row` in a box written with 128-byte swizzle
// (chunk index XOR row % 8 inside each 1024-byte group of 8 rows).  An
// explicit ld.shared: through a generic pointer the compiler emitted generic
// loads (tracked like global ones: ncu showed long-scoreboard stalls and no
// shared-load instructions).
__device__ __forceinline__ uint4 swizzled_chunk(uint32_t box, int row, int kc) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(box + row * 128 + ((kc ^ (row & 7)) << 4)));
  return v;
}

// Rowwise data and 1x128 row scales of consumer thread (c, g).
template <typename IType, bool kE5M2>
__device__ __forceinline__ void ring_rows(const QuantizeArgs& args, const RingSlot& s, const uint8_t* stage) {
  const int c = threadIdx.x & 15;
  const int g = threadIdx.x >> 4;
  const int lane = threadIdx.x & 31;
  const int64_t col0 = static_cast<int64_t>(s.tile_x) * kTile;
  const bool col_ok = c * kVec < args.cols - col0;
  const uint32_t box = static_cast<uint32_t>(__cvta_generic_to_shared(stage)) + (c >> 3) * kHalfBytes;
  RawVec8<IType> raw[kRowsPerThread];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const int row = g * kRowsPerThread + r;
    // rows past the member belong to the next one (or are TMA's zero fill)
    raw[r].w[0] = (col_ok && row < s.ti.rows_valid) ? swizzled_chunk(box, row, c & 7) : make_uint4(0, 0, 0, 0);
  }
  float my_scale, row_scale[kRowsPerThread];
  row_scales_1x128<IType, kE5M2>(args, raw, c, lane, my_scale, row_scale);
  store_rowwise<IType, kE5M2>(args, s.ti, col0, raw, row_scale, c, g, col_ok);
  const int bx_count = static_cast<int>(ceil_div<int64_t>(args.cols, kTile));
  store_row_scales_1x128(args, s.ti, s.tile_x, bx_count, my_scale, c, g);
}

// 64-bit value rotated left by `bytes` bytes (0..7).
__device__ __forceinline__ uint2 rotate_bytes_left(uint2 v, int bytes) {
  if (bytes >= 4) v = make_uint2(v.y, v.x);
  const int sh = (bytes & 3) * 8;
  return make_uint2(__funnelshift_l(v.y, v.x, sh), __funnelshift_l(v.x, v.y, sh));
}

// Transposed (columnwise) data and 128x1 column scales of consumer warp
// `warp`, lane (q, rho) = (lane & 1, lane >> 1).
template <typename IType, bool kE5M2>
__device__ __forceinline__ void ring_columns(const QuantizeArgs& args, const RingSlot& s, const uint8_t* stage,
                                             int warp, int lane) {
  const TileInfo& ti = s.ti;
  const int64_t K = args.cols;
  const int q = lane & 1;
  const int rho = lane >> 1;
  const int chunk = 2 * warp + q;  // 8-column chunk of the tile
  const int64_t col0 = static_cast<int64_t>(s.tile_x) * kTile;
  const bool col_ok = chunk * kVec < K - col0;
  const uint32_t box = static_cast<uint32_t>(__cvta_generic_to_shared(stage)) + (chunk >> 3) * kHalfBytes;
  const int rot = rho & 7;
  RawVec8<IType> v[kRowsPerThread];  // v[i]: row 8 rho + ((i + rot) & 7)
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int row = kRowsPerThread * rho + ((i + rot) & 7);
    v[i].w[0] = (col_ok && row < ti.rows_valid) ? swizzled_chunk(box, row, chunk & 7) : make_uint4(0, 0, 0, 0);
  }
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
  // Lane (q, rho) computes the scale of column rot of the chunk; the chunk's
  // lanes share the 8 scales by shuffles.
  // (a select tree: an indexed pick from m[] would go through local memory)
  const uint32_t lo_pair = (rot & 2) ? m[1] : m[0];
  const uint32_t hi_pair = (rot & 2) ? m[3] : m[2];
  const uint32_t mine = (rot & 4) ? hi_pair : lo_pair;
  const float my_scale = compute_block_scale(half_to_float<IType>(mine, (rot & 1) != 0), Fp8Traits<kE5M2>::kMax,
                                             args.pow2_scales, args.amax_epsilon, InputTraits<IType>::max_finite());
  float cs[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) cs[e] = __shfl_sync(0xffffffffu, my_scale, q + 2 * e);

  // Member block is (K, pitch): pitch = round_up(M_t, 128) with zero tokens
  // (grouped) or M (single tensor, M % 8 == 0 here).
  const int64_t pitch = args.pad_columnwise_tokens ? round_up<int64_t>(ti.m, kTile) : ti.m;
  const int tokens = args.pad_columnwise_tokens ? kTile : ti.rows_valid;
  uint8_t* out = static_cast<uint8_t*>(args.out_col_data) + K * ti.pad128_start + ti.local_tile * kTile +
                 (col0 + chunk * kVec) * pitch + kRowsPerThread * rho;
  const bool store = col_ok && kRowsPerThread * rho < tokens;
#pragma unroll
  for (int e = 0; e < kVec; ++e, out += pitch) {
    const float sc = cs[e];
    uint2 packed;  // byte i: step i
    packed.x = cvt_fp8x2<kE5M2>(__fmul_rn(elem<IType>(v[0], e), sc), __fmul_rn(elem<IType>(v[1], e), sc)) |
               (static_cast<uint32_t>(
                    cvt_fp8x2<kE5M2>(__fmul_rn(elem<IType>(v[2], e), sc), __fmul_rn(elem<IType>(v[3], e), sc)))
                << 16);
    packed.y = cvt_fp8x2<kE5M2>(__fmul_rn(elem<IType>(v[4], e), sc), __fmul_rn(elem<IType>(v[5], e), sc)) |
               (static_cast<uint32_t>(
                    cvt_fp8x2<kE5M2>(__fmul_rn(elem<IType>(v[6], e), sc), __fmul_rn(elem<IType>(v[7], e), sc)))
                << 16);
    if (store) *reinterpret_cast<uint2*>(out) = rotate_bytes_left(packed, rot);  // byte t: token t
  }
  // (ceil(M_t/128), round_up(K,4)) per member; K % 16 == 0: no padding.
  if (rho < kVec && col_ok) {
    float* sc = args.out_col_scale + K * (ti.pad128_start / kTile) + ti.local_tile * K + col0 + chunk * kVec + rho;
    *sc = __fdiv_rn(1.0f, my_scale);
  }
}

template <typename IType, bool kE5M2>
__global__ void __launch_bounds__(grouped::kRingThreads, 2)
    quantize_ring_kernel(const __grid_constant__ CUtensorMap map, const QuantizeArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (args.noop != nullptr && *args.noop == 1.0f) return;
  extern __shared__ __align__(16) uint8_t smem[];
  const int bx_count = static_cast<int>(ceil_div<int64_t>(args.cols, kTile));
  const RingTiles tiles{args.group, args.rows, bx_count, args.max_row_tiles * bx_count};
  const uint64_t evict_first = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST);
  auto load = [&](cutlass::arch::ClusterTransactionBarrier& full, uint8_t* stage, const RingSlot& s) {
    const int col0 = s.tile_x * kTile;
    const int row0 = static_cast<int>(s.ti.row0);
    const bool second = col0 + kBoxCols < args.cols;  // else its columns are never read
    full.arrive_and_expect_tx(second ? kStageBytes : kHalfBytes);
    uint64_t* bar = reinterpret_cast<uint64_t*>(&full);
    cute::SM90_TMA_LOAD_2D::copy(&map, bar, evict_first, stage, col0, row0);
    if (second) cute::SM90_TMA_LOAD_2D::copy(&map, bar, evict_first, stage + kHalfBytes, col0 + kBoxCols, row0);
  };
  auto consume = [&](const RingSlot& s, const uint8_t* stage, int warp, int lane) {
    if (args.out_col_data != nullptr) ring_columns<IType, kE5M2>(args, s, stage, warp, lane);
    if (args.out_data != nullptr) ring_rows<IType, kE5M2>(args, s, stage);
  };
  grouped::run_tile_ring<kStages, kStageBytes>(smem, tiles, load, consume);
#endif
}

template <typename IType, bool kE5M2>
cudaError_t launch_typed(const CUtensorMap& map, const QuantizeArgs& a, int64_t tiles, cudaStream_t stream) {
  auto kernel = quantize_ring_kernel<IType, kE5M2>;
  constexpr int smem = grouped::ring_smem_bytes<kStages, kStageBytes>();
  dim3 grid;
  LPMOE_RETURN_IF_ERROR(persistent_grid(kernel, grouped::kRingThreads, smem, tiles, grid));
  kernel<<<grid, grouped::kRingThreads, smem, stream>>>(map, a);
  return cudaGetLastError();
}

}  // namespace

bool ring_quantize_applies(const QuantizeArgs& a) {
  const bool sixteen_bit = a.input_dtype == DType::kBFloat16 || a.input_dtype == DType::kFloat16;
  return a.block_dim == 1 && sixteen_bit && a.dbias_workspace == nullptr &&
         reinterpret_cast<uintptr_t>(a.input) % 16 == 0 && a.rows <= 0x7fffffff - kTile && a.cols <= 0x7fffffff &&
         (a.out_col_data == nullptr || a.pad_columnwise_tokens || a.rows % 8 == 0);
}

cudaError_t launch_quantize_ring(const QuantizeArgs& a, int64_t tiles, cudaStream_t stream, bool& launched) {
  launched = false;
  int device = 0, major = 0;
  LPMOE_RETURN_IF_ERROR(cudaGetDevice(&device));
  LPMOE_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 9) return cudaSuccess;
  CUtensorMap map;
  if (!encode_2byte_rowmajor_map(&map, a.input, static_cast<uint64_t>(a.cols), static_cast<uint64_t>(a.rows),
                                 static_cast<uint64_t>(a.cols) * 2, kBoxCols, kTile))
    return cudaSuccess;
  launched = true;
  if (a.input_dtype == DType::kBFloat16)
    return a.e5m2 ? launch_typed<__nv_bfloat16, true>(map, a, tiles, stream)
                  : launch_typed<__nv_bfloat16, false>(map, a, tiles, stream);
  return a.e5m2 ? launch_typed<__half, true>(map, a, tiles, stream) : launch_typed<__half, false>(map, a, tiles, stream);
}

}  // namespace fp8_block
}  // namespace lpmoe
