// FP8 block-scaling dequantize, grouped or single tensor: out[r, k] =
// OType(fl(float(q) * scale_inv_of_block)) (formats.md §1.4, §1.8), always
// written untransposed as (rows, K).  Reads either the rowwise copy or the
// transposed columnwise copy (through the same swizzled shared tile as the
// quantize kernel).  Same 128x128 tile map as quantize: any member sizes.
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
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;
constexpr int kRowsPerThread = 8;

template <typename OType, bool kE5M2, int kBlockDim, bool kColumnwise>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const DequantizeArgs args) {
  // Linear grid ordered so that CTAs running together read contiguous
  // memory: K-tile fastest for the rowwise source (row bands), token-tile
  // fastest for the transposed source (runs of tokens of the same K rows).
  const int64_t K = args.cols;
  const int bx_count = static_cast<int>(ceil_div<int64_t>(K, kTile));
  const int64_t j = kColumnwise ? blockIdx.x % args.max_row_tiles : blockIdx.x / bx_count;
  const int tile_x = static_cast<int>(kColumnwise ? blockIdx.x / args.max_row_tiles : blockIdx.x % bx_count);
  TileInfo ti;
  if (!locate_tile(args.group, args.rows, j, ti)) return;
  const int64_t col0 = static_cast<int64_t>(tile_x) * kTile;
  const int cols_valid = static_cast<int>(K - col0 < kTile ? K - col0 : kTile);
  const uint8_t* q = static_cast<const uint8_t*>(args.data);
  OType* out = static_cast<OType*>(args.out);

  float tile_scale = 0.0f;
  if constexpr (kBlockDim == 2) {
    if constexpr (kColumnwise) {
      const int64_t tiles_m = ceil_div<int64_t>(ti.m, kTile);
      const int64_t ld = round_up<int64_t>(tiles_m, 4);
      tile_scale = args.scale[bx_count * (ti.pad512_start / kTile) + tile_x * ld + ti.local_tile];
    } else {
      const int ld = round_up(bx_count, 4);
      tile_scale = args.scale[ld * (ti.pad128_start / kTile) + ti.local_tile * ld + tile_x];
    }
  }

  if constexpr (!kColumnwise) {
    // Rowwise: 8 threads per row, 16 FP8 bytes (one 16-byte load) each;
    // 32 rows per pass, 4 passes.  K % 16 == 0: whole chunks only.
    const int chunk = threadIdx.x & 7;
    const bool col_ok = chunk * 16 < cols_valid;
    const int64_t ld = round_up<int64_t>(ti.m, 4);
    const float* row_scales = args.scale + bx_count * ti.pad4_start + tile_x * ld + ti.local_tile * kTile;
    uint4 raw[4];
    float s[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int row = (threadIdx.x >> 3) + 32 * p;
      if (col_ok && row < ti.rows_valid) {
        raw[p] = __ldg(reinterpret_cast<const uint4*>(q + (ti.row0 + row) * K + col0 + chunk * 16));
        s[p] = kBlockDim == 2 ? tile_scale : __ldg(row_scales + row);
      }
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int row = (threadIdx.x >> 3) + 32 * p;
      if (!col_ok || row >= ti.rows_valid) continue;
      const uint8_t* b = reinterpret_cast<const uint8_t*>(&raw[p]);
      float vals[16];
#pragma unroll
      for (int e = 0; e < 16; ++e) vals[e] = __fmul_rn(fp8_to_float<kE5M2>(b[e]), s[p]);
      store_vec<OType, 16>(out + (ti.row0 + row) * K + col0 + chunk * 16, vals);
    }
  } else {
    __shared__ __align__(16) uint8_t tposed[kTile * kTile];
    const int c = threadIdx.x & 15;
    const int g = threadIdx.x >> 4;
    const bool col_ok = c * kVec < cols_valid;
    const int64_t pitch = args.pad_columnwise_tokens ? round_up<int64_t>(ti.m, kTile) : ti.m;
    const uint8_t* src = q + K * ti.pad128_start + ti.local_tile * kTile;
    const bool aligned16 = (pitch % 16) == 0;
    // Issue all four 16-byte loads of this thread before touching shared
    // memory, so they are in flight together (one latency, not four).
    constexpr int kLoads = kTile * (kTile / 16) / kThreads;
    const int64_t tokens_in_buffer = args.pad_columnwise_tokens ? kTile : ti.rows_valid;
    uint4 val[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int u = threadIdx.x + i * kThreads;
      const int col = u >> 3;
      const int tok0 = (u & 7) * 16;
      val[i] = make_uint4(0, 0, 0, 0);
      if (col < cols_valid && tok0 < ti.rows_valid) {
        const uint8_t* sp = src + (col0 + col) * pitch + tok0;
        if (aligned16 && tok0 + 16 <= tokens_in_buffer) {
          val[i] = __ldg(reinterpret_cast<const uint4*>(sp));
        } else {
          uint8_t* b = reinterpret_cast<uint8_t*>(&val[i]);
          for (int k = 0; k < 16 && tok0 + k < ti.rows_valid; ++k) b[k] = sp[k];
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int u = threadIdx.x + i * kThreads;
      const int col = u >> 3;
      const int qi = u & 7;
      *reinterpret_cast<uint2*>(tposed + tile_chunk_offset(col, 2 * qi)) = make_uint2(val[i].x, val[i].y);
      *reinterpret_cast<uint2*>(tposed + tile_chunk_offset(col, 2 * qi + 1)) = make_uint2(val[i].z, val[i].w);
    }
    float s[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      if constexpr (kBlockDim == 1) {
        const int64_t ld = round_up<int64_t>(K, 4);
        s[e] = col_ok ? __ldg(args.scale + ld * (ti.pad128_start / kTile) + ti.local_tile * ld + col0 + c * kVec + e)
                      : 0.0f;
      } else {
        s[e] = tile_scale;
      }
    }
    __syncthreads();
    uint8_t bytes[kRowsPerThread][kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const uint2 chunk = *reinterpret_cast<const uint2*>(tposed + tile_chunk_offset(c * kVec + e, g));
      const uint8_t* b = reinterpret_cast<const uint8_t*>(&chunk);
#pragma unroll
      for (int r = 0; r < kRowsPerThread; ++r) bytes[r][e] = b[r];
    }
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int row = g * kRowsPerThread + r;
      if (!col_ok || row >= ti.rows_valid) continue;
      float vals[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) vals[e] = __fmul_rn(fp8_to_float<kE5M2>(bytes[r][e]), s[e]);
      store_vec<OType, kVec>(out + (ti.row0 + row) * K + col0 + c * kVec, vals);
    }
  }
}

template <typename OType, bool kE5M2>
cudaError_t launch_typed(const DequantizeArgs& a, dim3 grid, cudaStream_t s) {
  if (a.block_dim == 2) {
    if (a.columnwise) dequantize_kernel<OType, kE5M2, 2, true><<<grid, kThreads, 0, s>>>(a);
    else dequantize_kernel<OType, kE5M2, 2, false><<<grid, kThreads, 0, s>>>(a);
  } else {
    if (a.columnwise) dequantize_kernel<OType, kE5M2, 1, true><<<grid, kThreads, 0, s>>>(a);
    else dequantize_kernel<OType, kE5M2, 1, false><<<grid, kThreads, 0, s>>>(a);
  }
  return cudaGetLastError();
}

template <typename OType>
cudaError_t launch_fp8(const DequantizeArgs& a, dim3 grid, cudaStream_t s) {
  return a.e5m2 ? launch_typed<OType, true>(a, grid, s) : launch_typed<OType, false>(a, grid, s);
}

}  // namespace

cudaError_t launch_dequantize(const DequantizeArgs& a, cudaStream_t stream) {
  if (a.rows < 0 || a.cols < 0 || a.cols % 16 != 0 || (a.block_dim != 1 && a.block_dim != 2))
    return cudaErrorInvalidValue;
  if (a.rows == 0 || a.cols == 0 || a.max_row_tiles == 0) return cudaSuccess;
  const int64_t bx = ceil_div<int64_t>(a.cols, kTile);
  if (bx > 65535 || a.max_row_tiles > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const int64_t ctas = a.max_row_tiles * bx;
  if (ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(ctas));
  switch (a.out_dtype) {
    case DType::kFloat32: return launch_fp8<float>(a, grid, stream);
    case DType::kBFloat16: return launch_fp8<__nv_bfloat16>(a, grid, stream);
    case DType::kFloat16: return launch_fp8<__half>(a, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fp8_block
}  // namespace lpmoe
