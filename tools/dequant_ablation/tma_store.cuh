// Included by harness.cu only (after its using-declarations).
#pragma once
#include <cudaTypedefs.h>

// Write-side diagnostic (wrong output, "MISMATCH" expected): the bf16
// output written through TMA bulk tensor stores instead of 16-byte st.global,
// in lpmoe's tile order (token tiles fastest), one box of kBoxRows tokens x
// 128 K columns per tile from a shared tile filled once; persistent CTAs of
// one issuing thread each, at most kInFlight stores outstanding per CTA.
// If these writes ran at the copy's rate where st.global's ran at ~0.84
// (docs/perf-notes.md, stop 44), a staged tile that transposes into shared
// memory and stores by TMA would be worth building.
namespace tmaw {
inline CUtensorMap g_map128, g_map256;

inline bool encode(CUtensorMap* m, void* out, int64_t rows, int64_t cols, uint32_t box_rows) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess)
    return false;
  auto fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * 2};
  const cuuint32_t box[2] = {128, box_rows};
  const cuuint32_t elem[2] = {1, 1};
  return fn(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, out, dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int kBoxRows, int kInFlight>
__global__ void __launch_bounds__(128) writes(const __grid_constant__ CUtensorMap map, int64_t row_tiles,
                                              int64_t tiles) {
  extern __shared__ __align__(128) uint8_t smem[];
  for (int i = threadIdx.x; i < kBoxRows * 256 / 16; i += blockDim.x)
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(i, blockIdx.x, 0, 0);
  cute::tma_store_fence();
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int64_t i = blockIdx.x; i < tiles; i += gridDim.x) {
    const int64_t j = i % row_tiles;
    const int x = static_cast<int>(i / row_tiles);
    cute::SM90_TMA_STORE_2D::copy(&map, smem, x * 128, static_cast<int>(j * kBoxRows));
    cute::tma_store_arrive();
    cute::tma_store_wait<kInFlight>();
  }
  cute::tma_store_wait<0>();
}

template <int kBoxRows, int kInFlight>
void launch(const fp8_block::DequantizeArgs& b) {
  const int64_t row_tiles = (b.rows + kBoxRows - 1) / kBoxRows;
  const int64_t tiles = row_tiles * ((b.cols + 127) / 128);
  auto* k = writes<kBoxRows, kInFlight>;
  const int smem = kBoxRows * 256;
  static int ctas = 0;
  if (ctas == 0) {
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    int per_sm = 0, sms = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, 128, smem);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    ctas = per_sm * sms;
    printf("[tma-writes %d rows, %d in flight: %d CTAs/SM]\n", kBoxRows, kInFlight, per_sm);
  }
  k<<<unsigned(tiles < ctas ? tiles : ctas), 128, smem>>>(kBoxRows == 128 ? g_map128 : g_map256, row_tiles, tiles);
}
}  // namespace tmaw
