// NVFP4 quantize.  Pass 1: per-member amax (NaN-ignoring max|x|) with
// atomicMax on the float bits (non-negative floats order like their bits;
// max is order-independent, so the result is deterministic).  Pass 2: the
// two-level scale of formats.md §3.2 and E2M1 codes, rowwise (1x16 blocks
// along K) and columnwise (16 tokens per block, written transposed through a
// shared tile).  Thread (c, g) holds rows 8g..8g+7 x columns 8c..8c+7 of a
// 128x128 tile: a rowwise block is lanes c, c^1; a columnwise block is row
// groups g, g^1 = lanes l, l^16 of one warp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/cuda_utils.h"
#include "common/mx_numerics.cuh"
#include "common/numerics.cuh"
#include "common/vec_io.cuh"
#include "grouped/row_tiles.cuh"
#include "nvfp4/nvfp4.h"

namespace lpmoe {
namespace nvfp4 {
namespace {

using grouped::kTile;
using grouped::TileInfo;
using grouped::locate_tile;
constexpr int kThreads = 256;
constexpr int kVec = 8;
constexpr int kRows = 8;
constexpr float kFltMax = 3.402823466e38f;

template <typename IType>
__device__ __forceinline__ void load_tile(const QuantizeArgs& a, const TileInfo& ti, int64_t col0, int cols_valid,
                                          RawVec8<IType> (&raw)[kRows]) {
  const int c = threadIdx.x & 15;
  const int g = threadIdx.x >> 4;
  const bool col_ok = c * kVec < cols_valid;
  // This thread's first row; the next rows are K elements further (a running
  // pointer: one 64-bit add per row instead of a 64-bit multiply).
  const IType* in = static_cast<const IType*>(a.input) + (ti.row0 + g * kRows) * a.cols + col0 + c * kVec;
#pragma unroll
  for (int r = 0; r < kRows; ++r, in += a.cols) {
    const bool ok = col_ok && g * kRows + r < ti.rows_valid;
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(IType)) / 2; ++i)
      raw[r].w[i] = ok ? __ldg(reinterpret_cast<const uint4*>(in) + i) : make_uint4(0, 0, 0, 0);
  }
}

__global__ void zero_amax_kernel(float* amax, float* col_amax, int n, const float* noop) {
  if (noop != nullptr && *noop == 1.0f) return;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    amax[i] = 0.0f;
    if (col_amax) col_amax[i] = 0.0f;
  }
}

template <typename IType>
__global__ void __launch_bounds__(kThreads) amax_kernel(const QuantizeArgs a) {
  if (a.noop != nullptr && *a.noop == 1.0f) return;
  const int bx = static_cast<int>(ceil_div<int64_t>(a.cols, kTile));
  TileInfo ti;
  if (!locate_tile(a.group, a.rows, blockIdx.x / bx, ti) || ti.m % 16) return;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x % bx) * kTile;
  const int cols_valid = static_cast<int>(a.cols - col0 < kTile ? a.cols - col0 : kTile);
  RawVec8<IType> raw[kRows];
  load_tile<IType>(a, ti, col0, cols_valid, raw);
  float m = 0.0f;
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int e = 0; e < kVec; ++e) m = amax_step(m, elem<IType>(raw[r], e));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  __shared__ float warp_max[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
    if (m > 0.0f) {
      atomicMax(reinterpret_cast<unsigned int*>(a.amax + ti.member), __float_as_uint(m));
      if (a.col_amax) atomicMax(reinterpret_cast<unsigned int*>(a.col_amax + ti.member), __float_as_uint(m));
    }
  }
}

struct TwoLevel {
  float s_dec;   // fl(1 / S_enc)
  float mult;    // fl(S_enc * fl(1/6))
};

// formats.md §3.2, per-member part.
__device__ __forceinline__ TwoLevel global_scale(float amax) {
  float s_enc = __fdiv_rn(2688.0f, amax);  // fl(448 * 6) = 2688 exactly
  s_enc = fminf(s_enc, kFltMax);
  if (amax == 0.0f || s_enc == 0.0f) s_enc = 1.0f;
  return {__frcp_rn(s_enc), __fmul_rn(s_enc, __uint_as_float(0x3E2AAAABu))};
}

// Block part (formats.md §3.2).  The encode multiplier depends only on the
// scale byte and the member's S_dec, so a CTA (one member's tile) computes it
// once for each of the 127 bytes a block can get (<= 448: 0x00..0x7E; the
// block amax is never NaN, and the saturating conversion maps inf to 0x7E) into
// shared memory, and a block reads it back: one load instead of a correctly
// rounded reciprocal per block, which issue-bound NVFP4 quantize would pay
// 16 times per thread.
constexpr int kScaleBytes = 127;

__device__ __forceinline__ float encode_multiplier(uint8_t sf, const TwoLevel& s) {
  // __frcp_rn is the correctly rounded 1/x (same bits as IEEE 1.0f / x, cheaper).
  return fminf(__frcp_rn(__fmul_rn(fp8_to_float<false>(sf), s.s_dec)), kFltMax);  // sf == 0 -> inf -> FLT_MAX
}

// The stored E4M3 scale byte of a block.  min(., FLT_MAX) of the spec is
// left to the saturating conversion: inf and FLT_MAX both give 448.
__device__ __forceinline__ uint8_t block_scale_byte(float bamax, const TwoLevel& s) {
  return float_to_e4m3_sat(__fmul_rn(bamax, s.mult));
}

// Three CTAs per SM (80 registers) for 16-bit inputs: the kernel is bound by
// instruction issue and needs the warps.  fp32 inputs hold twice the raw
// registers and would spill at 80.
template <typename IType>
constexpr int kQuantizeMinBlocks = sizeof(IType) == 4 ? 2 : 3;

template <typename IType>
__global__ void __launch_bounds__(kThreads, kQuantizeMinBlocks<IType>) quantize_kernel(const QuantizeArgs a) {
  if (a.noop != nullptr && *a.noop == 1.0f) return;
  const int bx = static_cast<int>(ceil_div<int64_t>(a.cols, kTile));
  TileInfo ti;
  if (!locate_tile(a.group, a.rows, blockIdx.x / bx, ti) || ti.m % 16) return;
  const int64_t K = a.cols;
  const int tile_x = static_cast<int>(blockIdx.x % bx);
  const int64_t col0 = static_cast<int64_t>(tile_x) * kTile;
  const int cols_valid = static_cast<int>(K - col0 < kTile ? K - col0 : kTile);
  const int c = threadIdx.x & 15;
  const int g = threadIdx.x >> 4;
  const bool col_ok = c * kVec < cols_valid;
  const int64_t member_row0 = ti.row0 - ti.local_tile * kTile;
  RawVec8<IType> raw[kRows];
  load_tile<IType>(a, ti, col0, cols_valid, raw);
  auto V = [&](int r, int e) { return elem<IType>(raw[r], e); };
  const TwoLevel s = global_scale(a.amax[ti.member]);
  __shared__ float enc_of_scale[kScaleBytes];
  if (threadIdx.x < kScaleBytes) enc_of_scale[threadIdx.x] = encode_multiplier(threadIdx.x, s);
  __syncthreads();

  if (a.out_data != nullptr) {
    const int64_t sx = round_up<int64_t>(K / 16, 4);
    // Row g*8+r's data and scale byte: row g*8's plus r steps (inside one
    // 128-row tile the swizzled scale step is 16 bytes).
    const int64_t j = (col0 + c * kVec) / 16;
    const int64_t i0 = ti.local_tile * kTile + g * kRows;
    uint8_t* scale_out = a.out_scale + ti.pad128_start * sx + (a.swizzled ? swizzled_index(i0, j, sx / 4) : i0 * sx + j);
    const int64_t scale_step = a.swizzled ? 16 : sx;
    uint8_t* data_out = a.out_data + (ti.row0 + g * kRows) * (K / 2) + (col0 + c * kVec) / 2;
#pragma unroll
    for (int r = 0; r < kRows; ++r, data_out += K / 2) {
      const int row = g * kRows + r;
      float bamax = vec8_amax<IType>(raw[r]);
      bamax = fmaxf(bamax, __shfl_xor_sync(0xffffffffu, bamax, 1));
      const uint8_t sf = block_scale_byte(bamax, s);
      const float enc = enc_of_scale[sf];
      if (col_ok && row < ti.rows_valid) {
        *reinterpret_cast<uint32_t*>(data_out) = e2m1_pack8([&](int e) { return __fmul_rn(V(r, e), enc); });
      }
      if ((c & 1) == 0 && j < sx) scale_out[r * scale_step] = sf;
    }
  }

  if (a.out_col_data != nullptr) {
    // 128 K-rows x 64 bytes (128 tokens), 4-byte words XOR-swizzled by the
    // column group so the 16 lanes of a half-warp hit distinct banks.
    __shared__ uint32_t tposed[kTile * 16];
    const int64_t sxc = round_up<int64_t>(ti.m / 16, 4);
    const int64_t kp = round_up<int64_t>(K, kTile);
    const int64_t scale_base = kp * (ti.pad64_start / 16);
    const int64_t mb = (ti.local_tile * kTile + g * kRows) / 16;
    // Column col0+8c+e's scale byte: column 8c's plus e steps (swizzled: the
    // 8 columns stay inside one 32-row group of one 128-row tile: 16 bytes).
    const int64_t k0 = col0 + c * kVec;
    uint8_t* scale_out = a.out_col_scale + scale_base + (a.swizzled ? swizzled_index(k0, mb, sxc / 4) : k0 * sxc + mb);
    const int64_t scale_step = a.swizzled ? 16 : sxc;
    float bamax[kVec];  // 16-token block amax per column: row groups g, g^1
    column_amax16<IType>(raw, bamax);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const uint8_t sf = block_scale_byte(bamax[e], s);
      const float enc = enc_of_scale[sf];
      const int kk = c * kVec + e;
      tposed[kk * 16 + (g ^ (c & 15))] = e2m1_pack8([&](int r) { return __fmul_rn(V(r, e), enc); });
      if ((g & 1) == 0 && mb < sxc) scale_out[e * scale_step] = sf;
    }
    __syncthreads();
    // Member block (K, M_t/2) at K*row[t]/2; this tile's tokens start at byte
    // local_tile*64.  rows_valid % 16 == 0, so valid bytes come in 8s.
    const int64_t pitch = ti.m / 2;
    uint8_t* dst0 = a.out_col_data + K * member_row0 / 2 + ti.local_tile * (kTile / 2);
    const int bytes_valid = ti.rows_valid / 2;
    for (int u = threadIdx.x; u < kTile * 8; u += kThreads) {
      const int kk = u >> 3;
      const int q = u & 7;  // 8-byte unit = words 2q, 2q+1
      if (kk >= cols_valid || q * 8 >= bytes_valid) continue;
      const int cg = (kk >> 3) & 15;
      uint2 v;
      v.x = tposed[kk * 16 + ((2 * q) ^ cg)];
      v.y = tposed[kk * 16 + ((2 * q + 1) ^ cg)];
      *reinterpret_cast<uint2*>(dst0 + (col0 + kk) * pitch + q * 8) = v;
    }
  }
}

template <typename IType>
cudaError_t launch_typed(const QuantizeArgs& a, cudaStream_t s) {
  const int64_t bx = ceil_div<int64_t>(a.cols, kTile);
  const dim3 grid(static_cast<unsigned>(a.max_row_tiles * bx));
  amax_kernel<IType><<<grid, kThreads, 0, s>>>(a);
  LPMOE_RETURN_IF_ERROR(cudaGetLastError());
  if (a.out_data == nullptr && a.out_col_data == nullptr) return cudaSuccess;
  quantize_kernel<IType><<<grid, kThreads, 0, s>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_quantize(const QuantizeArgs& a, cudaStream_t stream) {
  if (a.cols % 16 != 0 || a.amax == nullptr) return cudaErrorInvalidValue;
  const int64_t bx = ceil_div<int64_t>(a.cols, kTile);
  if (a.max_row_tiles * bx > 0x7fffffff) return cudaErrorInvalidConfiguration;
  zero_amax_kernel<<<1, 256, 0, stream>>>(a.amax, a.col_amax, a.group.num_tensors, a.noop);
  LPMOE_RETURN_IF_ERROR(cudaGetLastError());
  if (a.rows == 0 || a.cols == 0 || a.max_row_tiles == 0) return cudaSuccess;
  switch (a.input_dtype) {
    case DType::kFloat32: return launch_typed<float>(a, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(a, stream);
    case DType::kFloat16: return launch_typed<__half>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace nvfp4
}  // namespace lpmoe
