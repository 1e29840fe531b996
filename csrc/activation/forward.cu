// Fused activation forward: h (rows, W) -> a = act(h) [* probs], rounded to
// the input dtype, written as high precision and/or as the FP8 block 1x128
// grouped operand of fc2 (rowwise + transposed columnwise).
//
// One pass over h: the gate (and value) tiles stream through shared memory
// (act_tiles.cuh); each thread computes its 8x8 block of a in registers and
// hands it to the tile quantizer while the next tile's copies land.  A bf16
// SwiGLU may take its sigmoid from a shared-memory table (sigmoid_table.cuh;
// heuristics.cu decides per device).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "activation/act_math.cuh"
#include "activation/act_tiles.cuh"
#include "activation/activation.h"
#include "activation/heuristics.h"
#include "activation/sigmoid_table.cuh"
#include "fp8_block/tile_quantize.cuh"

namespace lpmoe {
namespace activation {
namespace {

template <Kind K>
constexpr int forward_inputs() { return is_glu(K) ? 2 : 1; }

// Dynamic shared memory: the input stage, then the sigmoid table if any.
template <typename IType, Kind K, bool kTable>
constexpr int forward_smem_bytes() {
  return forward_inputs<K>() * stage_tile_bytes<IType>() + (kTable ? sigmoid_table::kBytes : 0);
}

// 2 CTAs per SM (16 warps): one 32-64 KB stage (+ the 31.7 KB sigmoid table)
// each, at most 128 registers.
template <typename IType, Kind K, bool kFp8, bool kTable>
__global__ void __launch_bounds__(kThreads, 2) forward_kernel(const ForwardArgs args) {
  static_assert(!kTable || sigmoid_table::used_by<IType, K>(), "the table holds bf16 gates' sigmoid");
  extern __shared__ __align__(128) uint8_t stage_buf[];
  __shared__ fp8_block::Smem sm;
  constexpr int kIn = forward_inputs<K>();
  constexpr int kTileBytes = stage_tile_bytes<IType>();
  const Common& c = args.c;
  const int64_t ld = is_glu(K) ? 2 * c.ffn : c.ffn;
  const IType* h = static_cast<const IType*>(args.h);
  RawVec8<IType> out[kStageRowsPerThread];
  float* table = reinterpret_cast<float*>(stage_buf + kIn * kTileBytes);
  if constexpr (kTable) {
    sigmoid_table::fill(table);
    __syncthreads();
  }

  auto stage = [&](uint8_t* buf, const TileRef& t) {
    const IType* gate = h + t.ti.row0 * ld + static_cast<int64_t>(t.x) * kTile;
    stage_tile_async<IType>(buf, gate, ld, t.ti.rows_valid, t.cols_valid);
    if constexpr (kIn == 2) stage_tile_async<IType>(buf + kTileBytes, gate + c.ffn, ld, t.ti.rows_valid, t.cols_valid);
  };
  auto compute = [&](const uint8_t* buf, const TileRef& t) {
    float p[kStageRowsPerThread];
    load_row_probs(c, t, p);
#pragma unroll
    for (int r = 0; r < kStageRowsPerThread; ++r) {
      RawVec8<IType> gate, value;
      read_stage_row<IType>(buf, r, gate);
      if constexpr (kIn == 2) read_stage_row<IType>(buf + kTileBytes, r, value);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float v = kIn == 2 ? elem<IType>(value, e) : 0.0f;
        float u;
        if constexpr (kTable) {  // math::forward<kSwiGLU> with the sigmoid looked up
          const float g = elem<IType>(gate, e);
          const float s = sigmoid_table::lookup_elem(table, gate, e);
          u = math::swiglu_forward(g, v, s);
        } else {
          u = math::forward<K>(elem<IType>(gate, e), v, c.params);
        }
        if (c.probs != nullptr) u = math::mul(u, p[r]);
        set_elem<IType>(out[r], e, u);
      }
    }
  };
  auto finish = [&](const uint8_t*, const TileRef& t, auto&& late) {
    late();  // nothing is staged late
    if (args.out != nullptr) store_tile<IType>(static_cast<IType*>(args.out), c.ffn, static_cast<int64_t>(t.x) * kTile, t, out);
    if constexpr (kFp8) fp8_block::process_tile<IType, false, 1>(args.fp8, t.ti, t.j, t.x, out, sm);
  };
  for_each_tile(c, stage_buf, stage, [](uint8_t*, const TileRef&) {}, compute, finish);
}

template <typename IType, bool kFp8>
cudaError_t launch_kind(const ForwardArgs& a, cudaStream_t stream) {
  return dispatch_kind(a.c.kind, [&]<Kind K>() {
    if constexpr (sigmoid_table::used_by<IType, K>()) {
      if (use_sigmoid_table(a.c)) {
        count_sigmoid_table_launch();
        return launch_tiles(forward_kernel<IType, K, kFp8, true>, forward_smem_bytes<IType, K, true>(), a.c, a,
                            stream);
      }
    }
    return launch_tiles(forward_kernel<IType, K, kFp8, false>, forward_smem_bytes<IType, K, false>(), a.c, a, stream);
  });
}

}  // namespace

cudaError_t launch_forward(const ForwardArgs& a, cudaStream_t stream) {
  const bool fp8 = a.fp8.out_data != nullptr || a.fp8.out_col_data != nullptr;
  if (a.c.rows < 0 || a.c.ffn < 0 || a.c.ffn % 16 != 0) return cudaErrorInvalidValue;
  if (fp8 && (a.fp8.e5m2 || a.fp8.block_dim != 1 || a.fp8.cols != a.c.ffn || a.c.dtype != DType::kBFloat16))
    return cudaErrorInvalidValue;
  if (a.c.rows == 0 || a.c.ffn == 0 || a.c.max_row_tiles == 0 || (!fp8 && a.out == nullptr)) return cudaSuccess;
  if (a.c.max_row_tiles * ceil_div<int64_t>(a.c.ffn, kTile) > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (fp8) return launch_kind<__nv_bfloat16, true>(a, stream);
  switch (a.c.dtype) {
    case DType::kBFloat16: return launch_kind<__nv_bfloat16, false>(a, stream);
    case DType::kFloat16: return launch_kind<__half, false>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace activation
}  // namespace lpmoe
