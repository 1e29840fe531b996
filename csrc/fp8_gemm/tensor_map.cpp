#include "fp8_gemm/tensor_map.h"

#include "common/tensor_maps.h"

namespace lpmoe {
namespace fp8_gemm {
bool encode_kmajor_fp8_map(CUtensorMap* map, int rank, const void* base, uint64_t k, uint64_t rows, uint64_t row_stride,
                           uint64_t members, uint64_t member_stride, uint32_t box_rows) {
  auto fn = tensor_map_encoder();
  if (fn == nullptr || rank < 2 || rank > 3) return false;
  const cuuint64_t dims[3] = {k, rows, members};
  const cuuint64_t strides[2] = {row_stride, member_stride};  // bytes, dims 1..rank-1
  const cuuint32_t box[3] = {128, box_rows, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, static_cast<cuuint32_t>(rank), const_cast<void*>(base),
                        dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

namespace {

// A packed (members, rows, cols) output tensor of `elem_bytes`-byte
// elements, written in (box_cols x box_rows) boxes whose rows are
// box_cols * elem_bytes bytes with the swizzle of that width (64 or 128);
// coordinates (col, row, member).
bool encode_output_map(CUtensorMap* map, CUtensorMapDataType type, uint64_t elem_bytes, void* base, uint64_t cols,
                       uint64_t rows, uint64_t members, uint32_t box_cols, uint32_t box_rows) {
  auto fn = tensor_map_encoder();
  const uint64_t box_row_bytes = box_cols * elem_bytes;
  if (fn == nullptr || (box_row_bytes != 64 && box_row_bytes != 128)) return false;
  const CUtensorMapSwizzle swizzle = box_row_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  const cuuint64_t dims[3] = {cols, rows, members};
  const cuuint64_t strides[2] = {cols * elem_bytes, cols * rows * elem_bytes};
  const cuuint32_t box[3] = {box_cols, box_rows, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = fn(map, type, 3, base, dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                        CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

}  // namespace

bool encode_fp32_rows_map(CUtensorMap* map, void* base, uint64_t cols, uint64_t rows, uint64_t members,
                          uint32_t box_cols, uint32_t box_rows) {
  if (box_cols * 4 != 128) return false;
  return encode_output_map(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, cols, rows, members, box_cols, box_rows);
}

bool encode_bf16_rows_map(CUtensorMap* map, void* base, uint64_t cols, uint64_t rows, uint32_t box_cols,
                          uint32_t box_rows) {
  if (box_cols * 2 != 64) return false;
  return encode_matrix_map(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, rows, cols, box_cols, box_rows,
                           CU_TENSOR_MAP_SWIZZLE_64B);
}

bool encode_bf16_members_map(CUtensorMap* map, void* base, uint64_t cols, uint64_t rows, uint64_t members,
                             uint32_t box_cols, uint32_t box_rows) {
  return encode_output_map(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, cols, rows, members, box_cols, box_rows);
}

}  // namespace fp8_gemm
}  // namespace lpmoe
