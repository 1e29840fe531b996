// The inverse of a routing map (permute.h, launch_row_sources): for each
// grouped row, the token whose slot was routed there.  A consumer that reads
// grouped rows straight from the token matrix (the FP8 quantize kernels'
// QuantizeArgs::row_source) walks rows, so it needs row -> token, while the
// routing map gives slot -> row.
#include "permute/permute.h"

#include <algorithm>

#include "common/cuda_utils.h"

namespace lpmoe {
namespace permute {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) row_sources_kernel(RowSourcesArgs a) {
  const int64_t slots = a.tokens * a.k;
  for (int64_t s = blockIdx.x * int64_t(kThreads) + threadIdx.x; s < slots; s += int64_t(gridDim.x) * kThreads) {
    const int32_t row = a.row_map[s];
    // A valid map names each row at most once, so every row has one writer.
    if (row >= 0 && row < a.rows) a.row_source[row] = static_cast<int32_t>(s / a.k);
  }
}

}  // namespace

cudaError_t launch_row_sources(const RowSourcesArgs& a, int sm_count, cudaStream_t stream) {
  if (a.k < 1 || a.tokens < 0 || a.rows < 0) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  // every byte 0xFF: each int32 reads -1 (no token) until a slot claims its row
  LPMOE_RETURN_IF_ERROR(cudaMemsetAsync(a.row_source, 0xFF, a.rows * sizeof(int32_t), stream));
  const int64_t slots = a.tokens * a.k;
  if (slots == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((slots + kThreads - 1) / kThreads, int64_t(sm_count) * 8);
  row_sources_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace permute
}  // namespace lpmoe
