// Host-side TMA descriptors for K-major FP8 operands (driver API entry point
// fetched through the runtime, so the extension does not link libcuda).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace lpmoe {
namespace fp8_gemm {

// Map over `members` matrices of `rows` rows x `k` bytes, rows `row_stride`
// bytes apart and members `member_stride` bytes apart; rank 2 (members and
// member_stride ignored: one matrix) or 3 (coordinates k, row, member).  It
// reads (128-byte x box_rows) boxes with 128-byte swizzle and zero fill
// outside the bounds.  Returns false (map untouched) when the driver
// rejects the layout (alignment, strides) or has no TMA.
bool encode_kmajor_fp8_map(CUtensorMap* map, int rank, const void* base, uint64_t k, uint64_t rows, uint64_t row_stride,
                           uint64_t members, uint64_t member_stride, uint32_t box_rows);

// Map over a (members, rows, cols) fp32 tensor (row-major, packed), read and
// written in (box_cols x box_rows) boxes with 128-byte swizzle (box_cols * 4
// must be 128); the coordinates are (col, row, member).
bool encode_fp32_rows_map(CUtensorMap* map, void* base, uint64_t cols, uint64_t rows, uint64_t members,
                          uint32_t box_cols, uint32_t box_rows);

// Map over a (rows, cols) row-major bf16 matrix written in (box_cols x
// box_rows) boxes with 64-byte swizzle (box_cols * 2 must be 64); the
// coordinates are (col, row).  The map clips columns past `cols` and rows
// past `rows`.
bool encode_bf16_rows_map(CUtensorMap* map, void* base, uint64_t cols, uint64_t rows, uint32_t box_cols,
                          uint32_t box_rows);

// The same over a (members, rows, cols) packed bf16 tensor, with boxes of
// 64- or 128-byte rows (box_cols 32 or 64) and the swizzle of that width;
// the coordinates are (col, row, member), and each member clips at its own
// `rows` and `cols`.
bool encode_bf16_members_map(CUtensorMap* map, void* base, uint64_t cols, uint64_t rows, uint64_t members,
                             uint32_t box_cols, uint32_t box_rows);

}  // namespace fp8_gemm
}  // namespace lpmoe
