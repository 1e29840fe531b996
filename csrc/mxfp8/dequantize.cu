// MXFP8 dequantize: y = OType(fl(2^(e-127) * float(q))) (formats.md §2.4),
// rowwise or columnwise source, compact or swizzled scales, any shape kind.
// The output has the data's element layout (members at the same offsets).
// One CTA per 128x128 tile (dequant_tile.cuh); 16-bit outputs of the rows
// layout leave whole tiles through TMA stores.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/cuda_utils.h"
#include "common/launch_counters.h"
#include "common/tensor_maps.h"
#include "mxfp8/dequant_tile.cuh"
#include "mxfp8/mxfp8.h"

namespace lpmoe {
namespace mxfp8 {
namespace {
using dequant_detail::kThreads;

LaunchCounters<DequantizeKernel> g_launches;
void count_launch(DequantizeKernel k) { g_launches.count(k); }

template <typename OType, bool kE5M2, bool kColumnwise>
__global__ void __launch_bounds__(kThreads) dequantize_stores_kernel(const DequantizeArgs args) {
  dequant_detail::dequantize_tile_stores<OType, kE5M2, kColumnwise>(args, blockIdx.x);
}

template <typename OType, bool kE5M2, bool kColumnwise>
__global__ void __launch_bounds__(kThreads)
    dequantize_tma_kernel(const DequantizeArgs args, const __grid_constant__ CUtensorMap out_map) {
  __shared__ __align__(128) uint8_t smem[dequant_detail::kOutTileBytes];
#if defined(CUTE_ARCH_TMA_SM90_ENABLED)
  dequant_detail::dequantize_tile_tma<OType, kE5M2, kColumnwise>(args, &out_map, blockIdx.x, smem);
#else  // code built for an architecture without TMA (below sm_90; Blackwell without "a"/"f"): 16-byte stores
  dequant_detail::dequantize_tile_stores<OType, kE5M2, kColumnwise>(args, blockIdx.x);
#endif
}

template <typename OType, bool kE5M2, bool kColumnwise>
cudaError_t launch_dir(const DequantizeArgs& a, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(a.num_tiles));
  if constexpr (sizeof(OType) == 2) {
    CUtensorMap out_map;
    // The whole (rows, cols) output in 128 x 128 boxes: the rows layout only
    // (members of varying K are not rows of one matrix).  False: 16-byte stores.
    if (!a.members.by_elements &&
        encode_output_tile_map(&out_map, std::is_same_v<OType, __half>, a.out, a.rows, a.cols)) {
      count_launch(DequantizeKernel::kTmaStores);
      dequantize_tma_kernel<OType, kE5M2, kColumnwise><<<grid, kThreads, 0, s>>>(a, out_map);
      return cudaGetLastError();
    }
  }
  count_launch(DequantizeKernel::kStores);
  dequantize_stores_kernel<OType, kE5M2, kColumnwise><<<grid, kThreads, 0, s>>>(a);
  return cudaGetLastError();
}

template <typename OType, bool kE5M2>
cudaError_t launch_e(const DequantizeArgs& a, cudaStream_t s) {
  return a.columnwise ? launch_dir<OType, kE5M2, true>(a, s) : launch_dir<OType, kE5M2, false>(a, s);
}

template <typename OType>
cudaError_t launch_typed(const DequantizeArgs& a, cudaStream_t s) {
  return a.e5m2 ? launch_e<OType, true>(a, s) : launch_e<OType, false>(a, s);
}

}  // namespace

int64_t dequantize_kernel_launches(DequantizeKernel kernel) { return g_launches.get(kernel); }

cudaError_t launch_dequantize(const DequantizeArgs& a, cudaStream_t stream) {
  if (a.num_tiles < 0 || a.num_tiles > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (!a.members.by_elements && a.cols % 16 != 0) return cudaErrorInvalidValue;
  if (a.num_tiles == 0) return cudaSuccess;
  switch (a.out_dtype) {
    case DType::kFloat32: return launch_typed<float>(a, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(a, stream);
    case DType::kFloat16: return launch_typed<__half>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace mxfp8
}  // namespace lpmoe
