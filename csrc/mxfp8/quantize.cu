// MXFP8 quantize: rowwise (1x32) and columnwise (32x1, not transposed) in one
// pass over each 128x128 tile.  Thread (c, g) holds rows 8g..8g+7 x columns
// 8c..8c+7: a 1x32 block spans 4 neighbouring lanes (2 shuffles); a 32x1
// block spans row groups 4q..4q+3 = two lanes of each of two warps (one
// shuffle + one shared-memory exchange).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/cuda_utils.h"
#include "common/cp_async.cuh"
#include "common/mx_numerics.cuh"
#include "common/numerics.cuh"
#include "common/persistent_grid.h"
#include "common/vec_io.cuh"
#include "mxfp8/member_tiles.cuh"
#include "mxfp8/mxfp8.h"

namespace lpmoe {
namespace mxfp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 8;
constexpr int kRows = 8;

// fl(1/fp8_max) computed as (float)(1.0 / max) (formats.md §0).
template <bool kE5M2>
__device__ __forceinline__ float max_rcp() {
  return kE5M2 ? static_cast<float>(1.0 / 57344.0) : static_cast<float>(1.0 / 448.0);
}

template <typename IType, bool kE5M2>
__device__ __forceinline__ void process_tile(const QuantizeArgs& args, const MxTile& t,
                                             const RawVec8<IType> (&raw)[kRows], float (&red)[kWarps][kTile]) {
  const int c = threadIdx.x & 15;
  const int g = threadIdx.x >> 4;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const bool col_ok = c * kVec < t.cols_valid;
  auto V = [&](int r, int e) { return elem<IType>(raw[r], e); };
  const float rcp = max_rcp<kE5M2>();

  if (args.out_data != nullptr) {
    // This thread's first row; the next rows are t.k bytes further.
    uint8_t* out = static_cast<uint8_t*>(args.out_data) + t.data_base + (t.r0 + g * kRows) * t.k + t.c0 + c * kVec;
    // Scale byte of row g*8+r: the index of row g*8 plus r steps (inside one
    // 128-row tile the swizzled step is 16 bytes), not an index per row.
    const int64_t scale_j = t.c0 / 32 + c / 4;
    const int64_t scale_step = args.swizzled ? 16 : t.sx;
    uint8_t* scale_out = args.out_scale + row_scale_index(t, t.r0 + g * kRows, scale_j, args.swizzled);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = g * kRows + r;
      float a = vec8_amax<IType>(raw[r]);
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
      const uint32_t e8 = float_to_e8m0(__fmul_rn(a, rcp));
      if (col_ok && row < t.rows_valid) {
        const float mult = exp2f_rcp(e8);
        uint2 packed;
        uint16_t* h = reinterpret_cast<uint16_t*>(&packed);
#pragma unroll
        for (int e = 0; e < kVec; e += 2)
          h[e / 2] = cvt_fp8x2<kE5M2>(__fmul_rn(V(r, e), mult), __fmul_rn(V(r, e + 1), mult));
        *reinterpret_cast<uint2*>(out) = packed;
      }
      out += t.k;
      // Every slot of the padded scale matrix inside this tile is written;
      // rows/blocks outside the member have amax 0 -> byte 0.
      if ((c & 3) == 0) scale_out[r * scale_step] = static_cast<uint8_t>(e8);
    }
  }

  if (args.out_col_data != nullptr) {
    float a[kVec];
    column_amax16<IType>(raw, a);
    if (lane < 16) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) red[warp][c * kVec + e] = a[e];
    }
    __syncthreads();
    // a[e] becomes the multiplier of column e; its scale byte is written at
    // once (no per-column byte array kept alive).
    const bool writes_scales = (g & 3) == 0;
    const int64_t mblk = (t.r0 + g * kRows) / 32;
    const int64_t k0 = t.c0 + c * kVec;
    // Swizzled: column k0+e's byte is 16 bytes after column k0+e-1's (the 8
    // columns stay inside one 32-column group of one 128-column tile).
    uint8_t* col_scale_out = args.out_col_scale + col_scale_index(t, mblk, k0, args.swizzled);
    uint2 packed_scales = make_uint2(0, 0);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float m = fmaxf(a[e], red[warp ^ 1][c * kVec + e]);  // warps 2q, 2q+1 share a 32-row block
      const uint32_t e8 = float_to_e8m0(__fmul_rn(m, rcp));
      a[e] = exp2f_rcp(e8);
      if (e < 4) packed_scales.x |= e8 << (8 * e);
      else packed_scales.y |= e8 << (8 * (e - 4));
      if (writes_scales && args.swizzled) col_scale_out[16 * e] = static_cast<uint8_t>(e8);
    }
    if (writes_scales && !args.swizzled) *reinterpret_cast<uint2*>(col_scale_out) = packed_scales;
    uint8_t* out = static_cast<uint8_t*>(args.out_col_data) + t.data_base + (t.r0 + g * kRows) * t.k + t.c0 + c * kVec;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = g * kRows + r;
      if (col_ok && row < t.rows_valid) {
        uint2 packed;
        uint16_t* h = reinterpret_cast<uint16_t*>(&packed);
#pragma unroll
        for (int e = 0; e < kVec; e += 2)
          h[e / 2] = cvt_fp8x2<kE5M2>(__fmul_rn(V(r, e), a[e]), __fmul_rn(V(r, e + 1), a[e + 1]));
        *reinterpret_cast<uint2*>(out) = packed;
      }
      out += t.k;
    }
  }
}

// Each thread stages exactly the 8 rows x 8 columns it later reads back.
template <typename IType>
__device__ __forceinline__ void prefetch_tile(const QuantizeArgs& args, const MxTile& t, uint8_t* stage) {
  const int c = threadIdx.x & 15;
  const int g = threadIdx.x >> 4;
  const bool col_ok = c * kVec < t.cols_valid;
  const IType* in = static_cast<const IType*>(args.input);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = g * kRows + r;
    const bool ok = col_ok && row < t.rows_valid;
    const IType* src = ok ? in + t.data_base + (t.r0 + row) * t.k + t.c0 + c * kVec : in;
    uint8_t* dst = stage + (row * kTile + c * kVec) * sizeof(IType);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(IType)) / 2; ++i)
      cp_async_16(dst + 16 * i, reinterpret_cast<const uint8_t*>(src) + 16 * i, ok);
  }
  cp_async_commit();
}

// Persistent CTAs (fp32 inputs): the next tile streams into shared memory
// (cp.async) while the current one is reduced and quantized from registers.
template <typename IType, bool kE5M2>
__global__ void __launch_bounds__(kThreads, 2) quantize_kernel(const QuantizeArgs args) {
  if (args.noop != nullptr && *args.noop == 1.0f) return;
  __shared__ float red[kWarps][kTile];
  extern __shared__ __align__(16) uint8_t stage[];
  const int c = threadIdx.x & 15;
  const int g = threadIdx.x >> 4;
  int64_t idx = blockIdx.x;
  MxTile t;
  // Tiles that locate to nothing (capacity tail, skipped members) are passed over.
  while (idx < args.num_tiles && !locate_mx_tile(args.members, args.rows, args.cols, args.numel, idx, t)) idx += gridDim.x;
  if (idx >= args.num_tiles) return;
  prefetch_tile<IType>(args, t, stage);
  while (true) {
    cp_async_wait_all();
    RawVec8<IType> raw[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* p = stage + ((g * kRows + r) * kTile + c * kVec) * sizeof(IType);
#pragma unroll
      for (int i = 0; i < static_cast<int>(sizeof(IType)) / 2; ++i) raw[r].w[i] = *reinterpret_cast<const uint4*>(p + 16 * i);
    }
    int64_t nidx = idx + gridDim.x;
    MxTile nt;
    while (nidx < args.num_tiles && !locate_mx_tile(args.members, args.rows, args.cols, args.numel, nidx, nt))
      nidx += gridDim.x;
    const bool has_next = nidx < args.num_tiles;
    if (has_next) prefetch_tile<IType>(args, nt, stage);
    process_tile<IType, kE5M2>(args, t, raw, red);
    if (!has_next) break;
    __syncthreads();  // `red` is reused by the next tile
    idx = nidx;
    t = nt;
  }
}

// One tile per CTA, loaded straight into registers (16-bit inputs): more
// CTAs per SM than the persistent kernel, whose shared-memory stage limited
// it to two; the same choice that made the FP8 block kernels faster
// (docs/perf-notes.md, v13).
template <typename IType, bool kE5M2>
__global__ void __launch_bounds__(kThreads, 3) quantize_tile_kernel(const QuantizeArgs args) {
  if (args.noop != nullptr && *args.noop == 1.0f) return;
  __shared__ float red[kWarps][kTile];
  MxTile t;
  if (!locate_mx_tile(args.members, args.rows, args.cols, args.numel, blockIdx.x, t)) return;  // whole CTA
  const int c = threadIdx.x & 15;
  const int g = threadIdx.x >> 4;
  const bool col_ok = c * kVec < t.cols_valid;
  // This thread's first row; the next rows are t.k elements further (a
  // running pointer: one 64-bit add per row instead of a 64-bit multiply).
  const IType* in = static_cast<const IType*>(args.input) + t.data_base + (t.r0 + g * kRows) * t.k + t.c0 + c * kVec;
  RawVec8<IType> raw[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r, in += t.k) {
    if (col_ok && g * kRows + r < t.rows_valid) {
      load_vec8<IType>(in, raw[r]);
    } else {
      zero_vec8<IType>(raw[r]);
    }
  }
  process_tile<IType, kE5M2>(args, t, raw, red);
}

template <typename IType, bool kE5M2>
cudaError_t launch_kernel(const QuantizeArgs& a, cudaStream_t s) {
  if constexpr (sizeof(IType) == 2) {
    quantize_tile_kernel<IType, kE5M2><<<dim3(static_cast<unsigned>(a.num_tiles)), kThreads, 0, s>>>(a);
  } else {  // fp32 tiles need 128 registers per thread: the persistent kernel
    auto kernel = quantize_kernel<IType, kE5M2>;
    const int stage_bytes = kTile * kTile * static_cast<int>(sizeof(IType));
    dim3 grid;
    LPMOE_RETURN_IF_ERROR(persistent_grid(kernel, kThreads, stage_bytes, a.num_tiles, grid));
    kernel<<<grid, kThreads, stage_bytes, s>>>(a);
  }
  return cudaGetLastError();
}

template <typename IType>
cudaError_t launch_typed(const QuantizeArgs& a, cudaStream_t s) {
  return a.e5m2 ? launch_kernel<IType, true>(a, s) : launch_kernel<IType, false>(a, s);
}

}  // namespace

cudaError_t launch_quantize(const QuantizeArgs& a, cudaStream_t stream) {
  if (a.num_tiles < 0 || a.num_tiles > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (!a.members.by_elements && a.cols % 16 != 0) return cudaErrorInvalidValue;
  if (a.num_tiles == 0 || (a.out_data == nullptr && a.out_col_data == nullptr)) return cudaSuccess;
  switch (a.input_dtype) {
    case DType::kFloat32: return launch_typed<float>(a, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(a, stream);
    case DType::kFloat16: return launch_typed<__half>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace mxfp8
}  // namespace lpmoe
