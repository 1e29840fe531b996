// FP8 block scaling (1x128 / 128x128) quantize, dequantize and grouped dbias.
//
// Grouped layout (docs/formats-notes.md): members are consecutive row blocks
// of a tall (rows, K) input; every output buffer is the concatenation of each
// member's single-tensor layout, located through row prefix sums padded to
// 1/4/128/512 rows (device arrays, N+1 entries each):
//   rowwise data     (M_t, K)              at K * row[t]
//   colwise data     (K, round_up(M_t,128)) at K * pad128[t]  (zero-padded tokens)
//   1D row scales    (ceil(K/128), round_up(M_t,4))            at bX * pad4[t]
//   1D col scales    (ceil(M_t/128), round_up(K,4))            at round_up(K,4) * pad128[t]/128
//   2D row scales    (ceil(M_t/128), round_up(bX,4))           at round_up(bX,4) * pad128[t]/128
//   2D col scales    (bX, round_up(ceil(M_t/128),4))           at bX * pad512[t]/128
// Scale padding entries are written as 0.  Work is split into 128x128 tiles
// that never straddle members (tile rows counted in pad128 space), so any
// member size works, including 0 and sizes that are not multiples of 128.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "common/dtypes.h"
#include "grouped/group_rows.h"

namespace lpmoe {
namespace fp8_block {

using grouped::GroupRows;

struct QuantizeArgs {
  const void* input = nullptr;  // (rows, K) row-major, 16-byte aligned
  DType input_dtype = DType::kBFloat16;
  int64_t rows = 0;             // buffer rows (capacity); rows past the members are ignored
  int64_t cols = 0;             // K, multiple of 16
  GroupRows group;
  bool e5m2 = false;
  int block_dim = 1;            // 1: 1x128, 2: 128x128
  bool pow2_scales = true;
  float amax_epsilon = 0.0f;
  void* out_data = nullptr;     // rowwise FP8 (rows, K) or null
  float* out_scale = nullptr;
  void* out_col_data = nullptr; // transposed FP8 or null
  float* out_col_scale = nullptr;
  // true: member columnwise blocks are (K, round_up(M_t,128)) zero padded
  // (grouped layout); false: exactly (K, M) (single tensor, one member).
  bool pad_columnwise_tokens = true;
  const float* noop = nullptr;  // *noop == 1 -> write nothing
  float* dbias_workspace = nullptr;  // (max_row_tiles, K) fp32 partial column sums, or null
  int64_t max_row_tiles = 0;    // grid bound: number of 128-row tiles in pad128 space
  // Rows gathered from a token matrix (an MoE permutation fused into the
  // quantization): logical row r of the grouped input is row row_source[r]
  // of `input` (source_rows x K), a zero row where row_source[r] is outside
  // [0, source_rows) (rows no slot was routed to).  Null: row r of `input`.
  // Taken by the one-tile-per-CTA kernels, for 16-bit inputs; launch_quantize
  // refuses it elsewhere (fp32 input, or an unpadded transposed copy of
  // M % 8 != 0 tokens, which take the persistent kernel).
  const int32_t* row_source = nullptr;
  int64_t source_rows = 0;
};

cudaError_t launch_quantize(const QuantizeArgs& args, cudaStream_t stream);

// Launches of each quantize kernel since the process started (so tests can
// prove which one a call took): the persistent cp.async kernel (1x128 with a
// transposed output: fp32 input, or an unpadded transposed copy of M % 8 !=
// 0 tokens), one tile per CTA (128x128 blocks, rowwise only), one tile per
// CTA with warp-local columns (1x128 with a transposed output, 16-bit
// input).
enum class QuantizeKernel { kPersistent = 0, kTile = 1, kTileColumns = 2, kCount = 3 };
int64_t quantize_kernel_launches(QuantizeKernel kernel);

struct DbiasReduceArgs {
  const float* workspace = nullptr;  // from launch_quantize
  GroupRows group;
  int64_t rows = 0;
  int64_t cols = 0;
  DType out_dtype = DType::kBFloat16;
  void* out = nullptr;               // (num_tensors, K)
  const float* noop = nullptr;
};

// dbias[t, k] = sum over member t's tiles, in tile order (deterministic).
cudaError_t launch_dbias_reduce(const DbiasReduceArgs& args, cudaStream_t stream);

struct DequantizeArgs {
  const void* data = nullptr;     // rowwise (rows, K) or columnwise layout
  const float* scale = nullptr;
  bool columnwise = false;        // read the transposed copy
  bool pad_columnwise_tokens = true;
  bool e5m2 = false;
  int block_dim = 1;
  int64_t rows = 0;
  int64_t cols = 0;
  GroupRows group;
  DType out_dtype = DType::kBFloat16;
  void* out = nullptr;            // (rows, K) row-major
  int64_t max_row_tiles = 0;
};

cudaError_t launch_dequantize(const DequantizeArgs& args, cudaStream_t stream);

// Launches of each dequantize kernel since the process started (tests prove
// which one a call took): rowwise source, columnwise source staged through
// shared memory (padded layout, or a single tensor of whole 128-row tiles)
// with 16-byte output stores (fp32 outputs), columnwise source transposed in
// registers (any other layout), and the staged tile whose 16-bit output
// leaves through TMA stores (bf16 and fp16 outputs; the 16-byte stores only
// where the driver has no tensor maps or the output passes 2^31 rows).
enum class DequantizeKernel {
  kRows = 0,
  kColumnsStaged = 1,
  kColumnsRegisters = 2,
  kColumnsStagedTma = 3,
  kCount = 4
};
int64_t dequantize_kernel_launches(DequantizeKernel kernel);

}  // namespace fp8_block
}  // namespace lpmoe
