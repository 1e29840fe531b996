// Host-side TMA descriptors shared by the kernel families.  The driver's
// cuTensorMapEncodeTiled is fetched through the runtime's entry-point query,
// so the extension does not link libcuda.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <climits>
#include <cstdint>

namespace lpmoe {

// The encoder, or nullptr where the driver has none (no TMA).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A row-major (rows, cols) matrix of `elem_bytes`-byte elements, rows packed
// (cols * elem_bytes apart), read or written in (box_cols x box_rows) boxes
// with `swizzle`; coordinates (col, row).  The unit clips boxes at the
// matrix's bounds.  False (map untouched) where the driver rejects the layout
// (base not 16-byte aligned, row pitch not a multiple of 16 bytes, a box the
// swizzle cannot take) or has no TMA.
inline bool encode_matrix_map(CUtensorMap* map, CUtensorMapDataType type, uint64_t elem_bytes, const void* base,
                              uint64_t rows, uint64_t cols, uint32_t box_cols, uint32_t box_rows,
                              CUtensorMapSwizzle swizzle) {
  auto fn = tensor_map_encoder();
  if (fn == nullptr) return false;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * elem_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  return fn(map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A 16-bit (rows, cols) output (fp16 or bf16) written in whole 128 x 128
// tiles by TMA stores (the dequantize kernels' staged output tiles): base
// 16-byte aligned and cols % 16 == 0 (so the row pitch is a multiple of 16
// bytes), rows and cols within the kernels' int box coordinates.  False
// (also where the driver has no TMA): the caller keeps its 16-byte stores.
inline bool encode_output_tile_map(CUtensorMap* map, bool fp16, void* out, int64_t rows, int64_t cols) {
  return reinterpret_cast<uintptr_t>(out) % 16 == 0 && rows >= 0 && cols >= 0 && rows <= INT_MAX &&
         cols <= INT_MAX && cols % 16 == 0 &&
         encode_matrix_map(map, fp16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, out,
                           static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), 128, 128,
                           CU_TENSOR_MAP_SWIZZLE_NONE);
}

}  // namespace lpmoe
