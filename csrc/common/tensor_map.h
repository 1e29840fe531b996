// Host-side TMA descriptors (driver API entry point fetched through the
// runtime, so the extension does not link libcuda).  One encoder for every
// kernel family that streams tiles with cp.async.bulk.tensor.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>

namespace lpmoe {

// cuTensorMapEncodeTiled, or null when the driver has no TMA.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder();

// Map over a row-major (rows x cols) matrix of 2-byte elements, rows
// `row_bytes` apart, read in (box_cols x box_rows) boxes with 128-byte
// swizzle (box_cols * 2 must be 128) and zero fill outside the matrix.
// Returns false (map untouched) when the driver rejects the layout
// (alignment, strides) or has no TMA.
bool encode_2byte_rowmajor_map(CUtensorMap* map, const void* base, uint64_t cols, uint64_t rows, uint64_t row_bytes,
                               uint32_t box_cols, uint32_t box_rows);

}  // namespace lpmoe
