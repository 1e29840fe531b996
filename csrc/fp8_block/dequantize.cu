// FP8 block-scaling dequantize, grouped or single tensor: out[r, k] =
// OType(fl(float(q) * scale_inv_of_block)) (formats.md §1.4, §1.8), always
// written untransposed as (rows, K).  Reads either the rowwise copy or the
// transposed columnwise copy (transposed back through shared memory or in
// registers: dequant_columns.cuh; through shared memory, 16-bit output
// tiles leave by TMA stores).  Same 128x128 tile map as quantize: any member sizes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/cuda_utils.h"
#include "common/launch_counters.h"
#include "common/dequant_vec.cuh"
#include "common/numerics.cuh"
#include "common/tensor_maps.h"
#include "fp8_block/dequant_columns.cuh"
#include "fp8_block/fp8_block.h"
#include "grouped/row_tiles.cuh"

namespace lpmoe {
namespace fp8_block {
using grouped::kTile;
using grouped::TileInfo;
using grouped::locate_tile;
namespace {
using dequant_detail::tile_scale_2d;

constexpr int kThreads = 256;

LaunchCounters<DequantizeKernel> g_launches;
void count_launch(DequantizeKernel k) { g_launches.count(k); }
// Rowwise CTAs take a slice of a 128x128 tile: more, shorter CTAs kept
// more loads in flight per SM (measured: 32-row slices 0.94-0.96 of copy,
// 64 rows 0.93-0.95, whole tiles 0.90-0.93).
constexpr int kRowSlices = 4;
constexpr int kSliceRows = kTile / kRowSlices;

// Rowwise source.  Each CTA takes a 32-row slice of a 128x128 tile; each
// thread loads the FP8 bytes of one 16-byte output vector per row it visits,
// so the 16 (bf16/fp16) or 32 (fp32) threads of a row store its 256 or 512
// bytes contiguously, and every load of a thread is issued before the first
// conversion.  Linear grid, K-tile fastest (CTAs running together read row
// bands).  K % 16 == 0: whole vectors only.
template <typename OType, bool kE5M2, int kBlockDim>
__global__ void __launch_bounds__(kThreads) dequantize_rows_kernel(const DequantizeArgs args) {
  using Chunk = DequantChunk<OType>;
  constexpr int kThreadsPerRow = kTile / Chunk::kElems;
  constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  constexpr int kPasses = kSliceRows / kRowsPerPass;
  const int64_t K = args.cols;
  const int bx_count = static_cast<int>(ceil_div<int64_t>(K, kTile));
  const int64_t tile = blockIdx.x / kRowSlices;
  const int row_base = static_cast<int>(blockIdx.x % kRowSlices) * kSliceRows;
  const int tile_x = static_cast<int>(tile % bx_count);
  TileInfo ti;
  if (!locate_tile(args.group, args.rows, tile / bx_count, ti) || row_base >= ti.rows_valid) return;
  const int64_t col0 = static_cast<int64_t>(tile_x) * kTile;
  const int cols_valid = static_cast<int>(K - col0 < kTile ? K - col0 : kTile);
  const int c = threadIdx.x % kThreadsPerRow;
  if (c * Chunk::kElems >= cols_valid) return;  // no barrier below
  const int row_in_pass = threadIdx.x / kThreadsPerRow;
  const uint8_t* q = static_cast<const uint8_t*>(args.data) + ti.row0 * K + col0 + c * Chunk::kElems;
  OType* out = static_cast<OType*>(args.out) + ti.row0 * K + col0 + c * Chunk::kElems;
  const float tile_scale = tile_scale_2d<kBlockDim, false>(args, ti, bx_count, tile_x);
  const float* row_scales =
      args.scale + bx_count * ti.pad4_start + tile_x * round_up<int64_t>(ti.m, 4) + ti.local_tile * kTile;

  typename Chunk::Bytes raw[kPasses];
  float s[kPasses];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int row = row_base + row_in_pass + kRowsPerPass * p;
    if (row < ti.rows_valid) {
      raw[p] = __ldg(reinterpret_cast<const typename Chunk::Bytes*>(q + row * K));
      s[p] = kBlockDim == 2 ? tile_scale : __ldg(row_scales + row);
    }
  }
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int row = row_base + row_in_pass + kRowsPerPass * p;
    if (row < ti.rows_valid)
      store16<Space::kGlobal>(out + row * K, dequant_chunk<OType, kE5M2>(raw[p], s[p]));
  }
}

// Columnwise source (dequant_columns.cuh).  Linear grids, token tiles
// fastest (CTAs running together read runs of tokens of the same K rows).
template <typename OType, bool kE5M2, int kBlockDim>
__global__ void __launch_bounds__(kThreads) dequantize_columns_kernel(const DequantizeArgs args) {
  dequant_detail::dequantize_columns_tile<OType, kE5M2, kBlockDim>(args, blockIdx.x % args.max_row_tiles,
                                                                   static_cast<int>(blockIdx.x / args.max_row_tiles));
}

template <typename OType, bool kE5M2, int kBlockDim>
__global__ void __launch_bounds__(kThreads, 3) dequantize_columns_staged_kernel(const DequantizeArgs args, int64_t chunks) {
  __shared__ __align__(16) uint8_t smem[dequant_detail::kStagedSmemBytes];
  dequant_detail::dequantize_columns_staged<OType, kE5M2, kBlockDim>(args, blockIdx.x % chunks,
                                                                     static_cast<int>(blockIdx.x / chunks), smem);
}

// 3 CTAs per SM: the TMA-store variant ran 0.02-0.06 of copy slower at 2
// and 4 (tools/dequant_ablation, H100, stop 57).
template <typename OType, bool kE5M2, int kBlockDim>
__global__ void __launch_bounds__(kThreads, 3)
    dequantize_columns_staged_tma_kernel(const DequantizeArgs args, const __grid_constant__ CUtensorMap out_map,
                                         int64_t chunks) {
  __shared__ __align__(128) uint8_t smem[dequant_detail::kStagedSmemBytes];
#if defined(CUTE_ARCH_TMA_SM90_ENABLED)
  dequant_detail::dequantize_columns_staged_tma<OType, kE5M2, kBlockDim>(args, &out_map, blockIdx.x % chunks,
                                                                         static_cast<int>(blockIdx.x / chunks), smem);
#else  // code built for an architecture without TMA (below sm_90; Blackwell without "a"/"f"): 16-byte stores
  dequant_detail::dequantize_columns_staged<OType, kE5M2, kBlockDim>(args, blockIdx.x % chunks,
                                                                     static_cast<int>(blockIdx.x / chunks), smem);
#endif
}

template <typename OType, bool kE5M2, int kBlockDim>
cudaError_t launch_dir(const DequantizeArgs& a, int64_t tiles, cudaStream_t s) {
  if (a.columnwise && dequant_detail::columns_staged(a)) {
    const int64_t chunks = ceil_div<int64_t>(a.max_row_tiles, dequant_detail::kStagedTiles);
    const auto ctas = static_cast<unsigned>(chunks * (tiles / a.max_row_tiles));
    if constexpr (sizeof(OType) == 2) {
      CUtensorMap out_map;
      // 128 x 128 boxes over the (rows, K) output (False: the 16-byte stores)
      if (encode_output_tile_map(&out_map, std::is_same_v<OType, __half>, a.out, a.rows, a.cols)) {
        count_launch(DequantizeKernel::kColumnsStagedTma);
        dequantize_columns_staged_tma_kernel<OType, kE5M2, kBlockDim><<<ctas, kThreads, 0, s>>>(a, out_map, chunks);
        return cudaGetLastError();
      }
    }
    count_launch(DequantizeKernel::kColumnsStaged);
    dequantize_columns_staged_kernel<OType, kE5M2, kBlockDim><<<ctas, kThreads, 0, s>>>(a, chunks);
  } else if (a.columnwise) {
    count_launch(DequantizeKernel::kColumnsRegisters);
    dequantize_columns_kernel<OType, kE5M2, kBlockDim><<<static_cast<unsigned>(tiles), kThreads, 0, s>>>(a);
  } else {
    if (kRowSlices * tiles > 0x7fffffff) return cudaErrorInvalidConfiguration;
    count_launch(DequantizeKernel::kRows);
    dequantize_rows_kernel<OType, kE5M2, kBlockDim><<<static_cast<unsigned>(kRowSlices * tiles), kThreads, 0, s>>>(a);
  }
  return cudaGetLastError();
}

template <typename OType, bool kE5M2>
cudaError_t launch_typed(const DequantizeArgs& a, int64_t tiles, cudaStream_t s) {
  return a.block_dim == 2 ? launch_dir<OType, kE5M2, 2>(a, tiles, s) : launch_dir<OType, kE5M2, 1>(a, tiles, s);
}

template <typename OType>
cudaError_t launch_fp8(const DequantizeArgs& a, int64_t tiles, cudaStream_t s) {
  return a.e5m2 ? launch_typed<OType, true>(a, tiles, s) : launch_typed<OType, false>(a, tiles, s);
}

}  // namespace

int64_t dequantize_kernel_launches(DequantizeKernel kernel) { return g_launches.get(kernel); }

cudaError_t launch_dequantize(const DequantizeArgs& a, cudaStream_t stream) {
  if (a.rows < 0 || a.cols < 0 || a.cols % 16 != 0 || (a.block_dim != 1 && a.block_dim != 2))
    return cudaErrorInvalidValue;
  if (a.rows == 0 || a.cols == 0 || a.max_row_tiles == 0) return cudaSuccess;
  const int64_t bx = ceil_div<int64_t>(a.cols, kTile);
  if (bx > 65535 || a.max_row_tiles > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const int64_t ctas = a.max_row_tiles * bx;
  if (ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  switch (a.out_dtype) {
    case DType::kFloat32: return launch_fp8<float>(a, ctas, stream);
    case DType::kBFloat16: return launch_fp8<__nv_bfloat16>(a, ctas, stream);
    case DType::kFloat16: return launch_fp8<__half>(a, ctas, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fp8_block
}  // namespace lpmoe
