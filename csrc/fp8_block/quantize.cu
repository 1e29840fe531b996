// FP8 block-scaling quantize (1x128 and 128x128), grouped or single tensor,
// rowwise and transposed columnwise outputs in one pass over the input, with
// optional per-tile column sums for a fused, deterministic bias gradient.
//
// One CTA works on 128x128 input tiles; the per-tile work (scales, rowwise
// data, transposed copy, column sums) is fp8_block/tile_quantize.cuh, shared
// with the fused activation kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/cuda_utils.h"
#include "common/launch_counters.h"
#include "common/persistent_grid.h"
#include "common/tile_stage.cuh"
#include "fp8_block/tile_columns.cuh"
#include "fp8_block/tile_quantize.cuh"

namespace lpmoe {
namespace fp8_block {
namespace {

LaunchCounters<QuantizeKernel> g_launches;
void count_launch(QuantizeKernel k) { g_launches.count(k); }

// Row of `input` that gathered row r reads (QuantizeArgs::row_source), -1
// (a zero row) for an entry outside the token matrix.
__device__ __forceinline__ int64_t gathered_row(const QuantizeArgs& a, int64_t r) {
  const int32_t s = a.row_source[r];
  return (s >= 0 && s < a.source_rows) ? s : -1;
}

// This thread's 8 rows x 8 columns of tile (ti, col0), zeros outside the
// member, the matrix or (kGather) the routed rows.  A template flag, so the
// plain kernels compile exactly as they did before gathering existed.
// (c, g: the thread's column group and row group; col_ok: its 8 columns
// lie inside the matrix.)
template <typename IType, bool kGather>
__device__ __forceinline__ void load_tile_part(const QuantizeArgs& args, const TileInfo& ti, int64_t col0, int c,
                                               int g, bool col_ok, RawVec8<IType> (&raw)[kRowsPerThread]) {
  const int64_t K = args.cols;
  const IType* in = static_cast<const IType*>(args.input);
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const int row = g * kRowsPerThread + r;
    if constexpr (kGather) {
      const int64_t src = (col_ok && row < ti.rows_valid) ? gathered_row(args, ti.row0 + row) : -1;
      if (src >= 0) {
        load_vec8<IType>(in + src * K + col0 + c * kVec, raw[r]);
      } else {
        zero_vec8<IType>(raw[r]);
      }
    } else {
      if (col_ok && row < ti.rows_valid) {
        load_vec8<IType>(in + (ti.row0 + row) * K + col0 + c * kVec, raw[r]);
      } else {
        zero_vec8<IType>(raw[r]);
      }
    }
  }
}

// ---- one tile per CTA (2D blocks and rowwise-only output: measured faster
// this way, docs/perf-notes.md) --------------------------------------------
template <typename IType, bool kE5M2, int kBlockDim, bool kGather>
__global__ void __launch_bounds__(kThreads, 3) quantize_tile_kernel(const QuantizeArgs args) {
  if (args.noop != nullptr && *args.noop == 1.0f) return;
  __shared__ Smem sm;
  // Linear grid, K-tile fastest: CTAs running together read whole row bands.
  const int64_t K = args.cols;
  const int bx_count = static_cast<int>(ceil_div<int64_t>(K, kTile));
  const int64_t j = blockIdx.x / bx_count;
  const int tile_x = static_cast<int>(blockIdx.x % bx_count);
  TileInfo ti;
  if (!locate_tile(args.group, args.rows, j, ti)) return;
  const int64_t col0 = static_cast<int64_t>(tile_x) * kTile;
  const int c = threadIdx.x & 15;
  const int g = threadIdx.x >> 4;
  const bool col_ok = c * kVec < K - col0;
  RawVec8<IType> raw[kRowsPerThread];
  load_tile_part<IType, kGather>(args, ti, col0, c, g, col_ok, raw);
  process_tile<IType, kE5M2, kBlockDim>(args, ti, j, tile_x, raw, sm);
}

// ---- 1x128 with a transposed output, 16-bit inputs: one tile per CTA.  The
// rows are quantized from registers; the columns by each warp from a swizzled
// copy of the tile (tile_columns.cuh), one CTA barrier per tile instead of
// the cross-warp column-amax and transpose phases of process_tile. --------
template <typename IType, bool kE5M2, bool kGather>
__global__ void __launch_bounds__(kThreads, 3) quantize_tile_columns_kernel(const QuantizeArgs args) {
  if (args.noop != nullptr && *args.noop == 1.0f) return;
  __shared__ __align__(16) uint8_t staged[kSwizzledTileBytes];
  __shared__ __align__(16) float red[kWarps][kTile];  // dbias partials
  const int64_t K = args.cols;
  const int bx_count = static_cast<int>(ceil_div<int64_t>(K, kTile));
  const int64_t j = blockIdx.x / bx_count;
  const int tile_x = static_cast<int>(blockIdx.x % bx_count);
  TileInfo ti;
  if (!locate_tile(args.group, args.rows, j, ti)) return;  // the whole CTA: same tile
  const int64_t col0 = static_cast<int64_t>(tile_x) * kTile;
  const int c = threadIdx.x & 15;
  const int g = threadIdx.x >> 4;
  const int lane = threadIdx.x & 31;
  const bool col_ok = c * kVec < K - col0;
  RawVec8<IType> raw[kRowsPerThread];
  load_tile_part<IType, kGather>(args, ti, col0, c, g, col_ok, raw);
  const uint32_t tile = static_cast<uint32_t>(__cvta_generic_to_shared(staged));
  stage_swizzled_tile<IType>(tile, raw, c, g);
  // same sums, same order as process_tile: the fused activation's dbias matches
  if (args.dbias_workspace != nullptr) column_sum_partials<IType>(raw, red, threadIdx.x >> 5, lane, c);
  if (args.out_data != nullptr) {
    float my_scale, row_scale[kRowsPerThread];
    row_scales_1x128<IType, kE5M2>(args, raw, c, lane, my_scale, row_scale);
    store_rowwise<IType, kE5M2>(args, ti, col0, raw, row_scale, c, g, col_ok);
    store_row_scales_1x128(args, ti, tile_x, bx_count, my_scale, c, g);
  }
  __syncthreads();
  if (args.dbias_workspace != nullptr)
    write_column_sums(args, red, j, col0, static_cast<int>(K - col0 < kTile ? K - col0 : kTile));
  quantize_columns_1x128<IType, kE5M2>(args, ti, tile_x, tile, threadIdx.x >> 5, lane);
}

// ---- persistent driver: next tile streams into shared memory (cp.async,
// common/tile_stage.cuh) while the current one is reduced and transposed
// from registers. ---------------------------------------------------------
template <typename IType>
__device__ __forceinline__ void prefetch_tile(const QuantizeArgs& args, const TileInfo& ti, int tile_x,
                                              uint8_t* stage) {
  const int64_t col0 = static_cast<int64_t>(tile_x) * kTile;
  const int64_t left = args.cols - col0;
  const IType* in = static_cast<const IType*>(args.input) + ti.row0 * args.cols + col0;
  stage_tile_async<IType>(stage, in, args.cols, ti.rows_valid, static_cast<int>(left < kTile ? left : kTile));
  cp_async_commit();
}

// Used for 1D blocks with a transposed output, where the column reduction
// and the transpose leave the memory system idle without a prefetch.
template <typename IType, bool kE5M2, int kBlockDim>
__global__ void __launch_bounds__(kThreads, 3) quantize_persistent_kernel(const QuantizeArgs args) {
  if (args.noop != nullptr && *args.noop == 1.0f) return;
  __shared__ Smem sm;
  extern __shared__ __align__(16) uint8_t stage[];  // kTile*kTile*sizeof(IType) bytes
  const int bx_count = static_cast<int>(ceil_div<int64_t>(args.cols, kTile));
  const int64_t total = args.max_row_tiles * bx_count;

  // Linear tile order, K-tile fastest: CTAs running together read whole row bands.
  int64_t idx = blockIdx.x;
  int64_t j = idx / bx_count;
  int tile_x = static_cast<int>(idx % bx_count);
  TileInfo ti;
  if (idx >= total || !locate_tile(args.group, args.rows, j, ti)) return;
  prefetch_tile<IType>(args, ti, tile_x, stage);
  while (true) {
    cp_async_wait_all();
    RawVec8<IType> raw[kRowsPerThread];
    read_stage_tile<IType>(stage, raw);
    // Start the next tile's copy before working on this one.
    const int64_t nidx = idx + gridDim.x;
    const int64_t nj = nidx / bx_count;
    const int ntile_x = static_cast<int>(nidx % bx_count);
    TileInfo nti;
    const bool has_next = nidx < total && locate_tile(args.group, args.rows, nj, nti);
    if (has_next) prefetch_tile<IType>(args, nti, ntile_x, stage);
    process_tile<IType, kE5M2, kBlockDim>(args, ti, j, tile_x, raw, sm);
    if (!has_next) break;
    __syncthreads();  // sm (reductions, transpose tile) is reused by the next tile
    idx = nidx;
    j = nj;
    tile_x = ntile_x;
    ti = nti;
  }
}

template <typename IType, bool kE5M2>
cudaError_t launch_persistent(const QuantizeArgs& a, int64_t tiles, cudaStream_t stream) {
  auto kernel = quantize_persistent_kernel<IType, kE5M2, 1>;
  const int stage_bytes = kTile * kTile * static_cast<int>(sizeof(IType));
  dim3 grid;
  LPMOE_RETURN_IF_ERROR(persistent_grid(kernel, kThreads, stage_bytes, tiles, grid));
  kernel<<<grid, kThreads, stage_bytes, stream>>>(a);
  return cudaGetLastError();
}

// The one-tile-per-CTA kernels: with a transposed 1x128 copy the columns
// kernel (16-bit inputs only), else the generic tile kernel.
template <typename IType, bool kE5M2, bool kGather>
cudaError_t launch_one_tile(const QuantizeArgs& a, int64_t tiles, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(tiles));
  if (a.block_dim == 1 && a.out_col_data != nullptr) {
    if constexpr (sizeof(IType) == 2) {
      count_launch(QuantizeKernel::kTileColumns);
      quantize_tile_columns_kernel<IType, kE5M2, kGather><<<grid, kThreads, 0, stream>>>(a);
      return cudaGetLastError();
    } else {
      return cudaErrorInvalidValue;
    }
  }
  count_launch(QuantizeKernel::kTile);
  if (a.block_dim == 2) {
    quantize_tile_kernel<IType, kE5M2, 2, kGather><<<grid, kThreads, 0, stream>>>(a);
  } else {
    quantize_tile_kernel<IType, kE5M2, 1, kGather><<<grid, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename IType, bool kE5M2>
cudaError_t launch_typed(const QuantizeArgs& a, int64_t tiles, cudaStream_t stream) {
  if (tiles > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const bool columns = a.block_dim == 1 && a.out_col_data != nullptr;
  // 16-bit inputs with whole 8-token chunks in the transposed copy: the
  // columns kernel; other inputs with a transposed 1x128 copy: persistent.
  const bool one_tile = !columns || (sizeof(IType) == 2 && (a.pad_columnwise_tokens || a.rows % 8 == 0));
  if (a.row_source != nullptr) {  // gathering: 16-bit inputs, one-tile kernels (QuantizeArgs::row_source)
    if constexpr (sizeof(IType) == 2) {
      if (one_tile) return launch_one_tile<IType, kE5M2, true>(a, tiles, stream);
    }
    return cudaErrorInvalidValue;
  }
  if (one_tile) return launch_one_tile<IType, kE5M2, false>(a, tiles, stream);
  count_launch(QuantizeKernel::kPersistent);
  return launch_persistent<IType, kE5M2>(a, tiles, stream);
}

template <typename IType>
cudaError_t launch_fp8(const QuantizeArgs& a, int64_t tiles, cudaStream_t stream) {
  return a.e5m2 ? launch_typed<IType, true>(a, tiles, stream) : launch_typed<IType, false>(a, tiles, stream);
}

// --- deterministic reduction of the per-tile column sums -------------------
// CTA = 32 columns x 8 tile lanes: lane l sums tiles l, l+8, l+16, ... of the
// member in order, then lane partials are added in lane order.  The
// assignment and order are fixed, so the result is bitwise reproducible, and
// a member with hundreds of tiles is summed 8-way in parallel.
constexpr int kDbiasCols = 32;
constexpr int kDbiasLanes = 8;

template <typename OType>
__global__ void __launch_bounds__(kDbiasCols * kDbiasLanes) dbias_reduce_kernel(const DbiasReduceArgs args) {
  if (args.noop != nullptr && *args.noop == 1.0f) return;
  const int t = blockIdx.y;
  const int col = threadIdx.x % kDbiasCols;
  const int lane = threadIdx.x / kDbiasCols;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kDbiasCols + col;
  int64_t first_tile = 0, tiles = 0;
  if (args.group.row == nullptr) {
    tiles = ceil_div<int64_t>(args.rows, kTile);
  } else {
    first_tile = args.group.pad128[t] / kTile;
    tiles = (args.group.pad128[t + 1] - args.group.pad128[t]) / kTile;
  }
  float acc = 0.0f;
  if (k < args.cols) {
    for (int64_t i = lane; i < tiles; i += kDbiasLanes) acc += args.workspace[(first_tile + i) * args.cols + k];
  }
  __shared__ float part[kDbiasLanes][kDbiasCols];
  part[lane][col] = acc;
  __syncthreads();
  if (lane == 0 && k < args.cols) {
    float sum = 0.0f;
#pragma unroll
    for (int l = 0; l < kDbiasLanes; ++l) sum += part[l][col];
    static_cast<OType*>(args.out)[t * args.cols + k] = from_float<OType>(sum);
  }
}

}  // namespace

cudaError_t launch_quantize(const QuantizeArgs& a, cudaStream_t stream) {
  if (a.rows < 0 || a.cols < 0 || a.cols % 16 != 0 || (a.block_dim != 1 && a.block_dim != 2))
    return cudaErrorInvalidValue;
  if (a.rows == 0 || a.cols == 0 || a.max_row_tiles == 0) return cudaSuccess;  // nothing to launch
  if (a.out_data == nullptr && a.out_col_data == nullptr && a.dbias_workspace == nullptr) return cudaSuccess;
  const int64_t bx = ceil_div<int64_t>(a.cols, kTile);
  if (bx > 65535 || a.max_row_tiles > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const int64_t tiles = a.max_row_tiles * bx;
  switch (a.input_dtype) {
    case DType::kFloat32: return launch_fp8<float>(a, tiles, stream);
    case DType::kBFloat16: return launch_fp8<__nv_bfloat16>(a, tiles, stream);
    case DType::kFloat16: return launch_fp8<__half>(a, tiles, stream);
    default: return cudaErrorInvalidValue;
  }
}

int64_t quantize_kernel_launches(QuantizeKernel kernel) { return g_launches.get(kernel); }

cudaError_t launch_dbias_reduce(const DbiasReduceArgs& a, cudaStream_t stream) {
  if (a.cols == 0 || a.group.num_tensors == 0) return cudaSuccess;
  const int threads = kDbiasCols * kDbiasLanes;
  const dim3 grid(static_cast<unsigned>(ceil_div<int64_t>(a.cols, kDbiasCols)), static_cast<unsigned>(a.group.num_tensors));
  switch (a.out_dtype) {
    case DType::kFloat32: dbias_reduce_kernel<float><<<grid, threads, 0, stream>>>(a); break;
    case DType::kBFloat16: dbias_reduce_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(a); break;
    case DType::kFloat16: dbias_reduce_kernel<__half><<<grid, threads, 0, stream>>>(a); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace fp8_block
}  // namespace lpmoe
