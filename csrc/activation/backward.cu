// Fused activation backward: da (rows, F) and the saved h (rows, W) ->
//   dh (rows, W) rounded to the input dtype, as high precision and/or as the
//      FP8 block 1x128 grouped operand of fc1's dgrad and wgrad (rowwise +
//      transposed), with optional per-tile column sums for fc1's bias grad;
//   per-(row, 128-column block) partial sums of da * u for d probs.
// One pass: da, gate and value tiles stream through shared memory
// (act_tiles.cuh); each thread computes its 8x8 blocks in registers and
// quantizes them while the next tile's copies land.
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
constexpr int backward_inputs() { return is_glu(K) ? 3 : 2; }  // da, gate[, value]

// Sum over the 16 lanes of a half-warp: halving tree (xor 8, 4, 2, 1).
__device__ __forceinline__ float half_warp_sum(float s) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) s = math::add(s, __shfl_xor_sync(0xffffffffu, s, o));
  return s;
}

// The FP8 bf16 SwiGLU backward may take its sigmoid from the table (31.7 KB;
// heuristics.cu decides per device).  To keep 2 CTAs per SM its da tile is
// then not staged but read straight into registers, after an L2 prefetch one
// tile ahead.  (H200, 8 x 64k tokens, F 2048: 511 -> 482 us.  The
// high-precision kernel never takes it: there the same change spills and runs
// 2 % slower.)
template <typename IType, Kind K, bool kFp8>
constexpr bool table_allowed() { return kFp8 && sigmoid_table::used_by<IType, K>(); }

template <typename IType, Kind K, bool kTable>
constexpr int backward_smem_bytes() {
  return (backward_inputs<K>() - (kTable ? 1 : 0)) * stage_tile_bytes<IType>() + (kTable ? sigmoid_table::kBytes : 0);
}

// 2 CTAs per SM (16 warps): a 96 KB stage (da, gate, value; or gate, value
// and the sigmoid table) + 17 KB of quantizer scratch each, at most 128
// registers.  Only one dh half is held in registers at a time: compute()
// parks the value half in this thread's own slots of the value stage (just
// read; refilled by the late copies, which finish issues once it has read the
// value half back), so nothing spills.
template <typename IType, Kind K, bool kFp8, bool kTable>
__global__ void __launch_bounds__(kThreads, 2) backward_kernel(const BackwardArgs args) {
  static_assert(!kTable || table_allowed<IType, K, kFp8>(), "the table serves the FP8 bf16 SwiGLU backward");
  extern __shared__ __align__(128) uint8_t stage_buf[];
  __shared__ fp8_block::Smem sm;
  constexpr bool kGlu = is_glu(K);
  constexpr int kTileBytes = stage_tile_bytes<IType>();
  constexpr bool kStageDa = !kTable;
  // stage layout: [da] gate [value] [sigmoid table]
  constexpr int kGate = kStageDa ? kTileBytes : 0;
  constexpr int kValue = kGate + kTileBytes;
  float* table = reinterpret_cast<float*>(stage_buf + kValue + (kGlu ? kTileBytes : 0));
  if constexpr (kTable) {
    sigmoid_table::fill(table);
    __syncthreads();
  }
  const Common& c = args.c;
  const int64_t ld = kGlu ? 2 * c.ffn : c.ffn;
  const int fb = static_cast<int>(ceil_div<int64_t>(c.ffn, kTile));
  const IType* h = static_cast<const IType*>(args.h);
  const IType* da = static_cast<const IType*>(args.da);
  const bool fp8_dh = kFp8 && (args.dh_fp8.out_data != nullptr || args.dh_fp8.out_col_data != nullptr ||
                               args.dh_fp8.dbias_workspace != nullptr);
  RawVec8<IType> dg[kStageRowsPerThread];

  auto stage = [&](uint8_t* buf, const TileRef& t) {
    const int64_t col0 = static_cast<int64_t>(t.x) * kTile;
    if constexpr (kStageDa) {
      stage_tile_async<IType>(buf, da + t.ti.row0 * c.ffn + col0, c.ffn, t.ti.rows_valid, t.cols_valid);
    } else {
      prefetch_tile_l2<IType>(da + t.ti.row0 * c.ffn + col0, c.ffn, t.ti.rows_valid, t.cols_valid);
    }
    stage_tile_async<IType>(buf + kGate, h + t.ti.row0 * ld + col0, ld, t.ti.rows_valid, t.cols_valid);
  };
  auto stage_late = [&](uint8_t* buf, const TileRef& t) {
    if constexpr (kGlu) {
      const int64_t col0 = static_cast<int64_t>(t.x) * kTile;
      stage_tile_async<IType>(buf + kValue, h + t.ti.row0 * ld + c.ffn + col0, ld, t.ti.rows_valid, t.cols_valid);
    }
  };
  auto compute = [&](uint8_t* buf, const TileRef& t) {
    float p[kStageRowsPerThread];
    load_row_probs(c, t, p);
    const int lane_c = threadIdx.x & 15, g = threadIdx.x >> 4;
    RawVec8<IType> d_direct[kStageDa ? 1 : kStageRowsPerThread];
    if constexpr (!kStageDa) load_tile_rows<IType>(da + t.ti.row0 * c.ffn + static_cast<int64_t>(t.x) * kTile, c.ffn,
                                                   t.ti.rows_valid, t.cols_valid, d_direct);
#pragma unroll
    for (int r = 0; r < kStageRowsPerThread; ++r) {
      RawVec8<IType> d, x, y, dvr;
      if constexpr (kStageDa) read_stage_row<IType>(buf, r, d);
      else d = d_direct[r];
      read_stage_row<IType>(buf + kGate, r, x);
      if constexpr (kGlu) read_stage_row<IType>(buf + kValue, r, y);
      float psum = 0.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float dA = elem<IType>(d, e);
        const float q = c.probs != nullptr ? math::mul(dA, p[r]) : dA;
        float gd, vd, u;
        if constexpr (kTable) {
          const float s = sigmoid_table::lookup_elem(table, x, e);
          math::swiglu_backward(elem<IType>(x, e), elem<IType>(y, e), q, s, gd, vd, u);
        } else {
          math::backward<K>(elem<IType>(x, e), kGlu ? elem<IType>(y, e) : 0.0f, q, c.params, gd, vd, u);
        }
        set_elem<IType>(dg[r], e, gd);
        if constexpr (kGlu) set_elem<IType>(dvr, e, vd);
        psum = math::fma(dA, u, psum);  // one rounding per column (docs/activation-notes.md)
      }
      if constexpr (kGlu) write_stage_row<IType>(buf + kValue, r, dvr);
      if (args.probs_partials != nullptr) {  // uniform: every lane shuffles
        psum = half_warp_sum(psum);
        const int row = g * kStageRowsPerThread + r;
        if (lane_c == 0 && row < t.ti.rows_valid) args.probs_partials[(t.ti.row0 + row) * fb + t.x] = psum;
      }
    }
  };
  auto finish = [&](const uint8_t* buf, const TileRef& t, auto&& late) {
    const int64_t col0 = static_cast<int64_t>(t.x) * kTile;
    if (args.dh != nullptr) store_tile<IType, true>(static_cast<IType*>(args.dh), ld, col0, t, dg);
    if constexpr (kFp8) {
      if (fp8_dh) fp8_block::process_tile<IType, false, 1>(args.dh_fp8, t.ti, t.j, t.x, dg, sm);
    }
    if constexpr (kGlu) {
      RawVec8<IType> dv[kStageRowsPerThread];
      read_stage_tile<IType>(buf + kValue, dv);
      // The value slots are free now.  When a second quantizer pass follows,
      // the next tile's value copies go out here and overlap it; issued after
      // the pass, they sat exposed at the next tile's wait (8 x 64k tokens,
      // F 2048, H100: 570 -> 537 us).  With high-precision outputs only they
      // keep their place after the stores (issuing them before the stores
      // measured 527 -> 533 us).
      const bool second_pass = kFp8 && fp8_dh;
      if (second_pass) late();
      if (args.dh != nullptr) store_tile<IType, true>(static_cast<IType*>(args.dh), ld, c.ffn + col0, t, dv);
      if constexpr (kFp8) {
        if (fp8_dh) {
          __syncthreads();
          fp8_block::process_tile<IType, false, 1>(args.dh_fp8, t.ti, t.j, t.x + fb, dv, sm);
        }
      }
      if (!second_pass) late();
    } else {
      late();
    }
  };
  for_each_tile(c, stage_buf, stage, stage_late, compute, finish);
}

template <typename IType, bool kFp8>
cudaError_t launch_kind(const BackwardArgs& a, cudaStream_t stream) {
  return dispatch_kind(a.c.kind, [&]<Kind K>() {
    if constexpr (table_allowed<IType, K, kFp8>()) {
      if (use_sigmoid_table(a.c)) {
        count_sigmoid_table_launch();
        return launch_tiles(backward_kernel<IType, K, kFp8, true>, backward_smem_bytes<IType, K, true>(), a.c, a,
                            stream);
      }
    }
    return launch_tiles(backward_kernel<IType, K, kFp8, false>, backward_smem_bytes<IType, K, false>(), a.c, a,
                        stream);
  });
}

bool has_fp8(const fp8_block::QuantizeArgs& q) { return q.out_data != nullptr || q.out_col_data != nullptr; }

bool fp8_ok(const fp8_block::QuantizeArgs& q, int64_t cols) {
  return !has_fp8(q) || (!q.e5m2 && q.block_dim == 1 && q.cols == cols);
}

constexpr int kReduceThreads = 256;

// d probs[t]: row t's partials added left to right.  With a multiple of 4
// partials per row (ceil(F/128) % 4 == 0, e.g. F 2048: 16 per row) they are
// read as 16-byte vectors, up to four vectors loaded before the first of
// their adds (the scalar loop waited on each load in turn: 3.5 -> 2.1 us for
// 64k rows x 16 partials on the H100, graph-replayed); the additions keep
// their order, so the bits are the same.
template <bool kVec4>
__global__ void __launch_bounds__(kReduceThreads) probs_grad_kernel(const ProbsGradArgs args) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kReduceThreads + threadIdx.x;
  if (t >= args.rows) return;
  const int64_t used = args.used_rows != nullptr ? *args.used_rows : args.rows;
  float s = 0.0f;
  if (t < used) {
    const float* row = args.partials + t * args.blocks;
    if constexpr (kVec4) {
      const float4* v = reinterpret_cast<const float4*>(row);
      int64_t b = 0;
      for (; b + 4 <= args.blocks / 4; b += 4) {  // 4 vectors (16 partials) in flight
        float4 q[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) q[i] = __ldg(v + b + i);
#pragma unroll
        for (int i = 0; i < 4; ++i) s = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(s, q[i].x), q[i].y), q[i].z), q[i].w);
      }
      for (; b < args.blocks / 4; ++b) {
        const float4 q = __ldg(v + b);
        s = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(s, q.x), q.y), q.z), q.w);
      }
    } else {
      for (int64_t b = 0; b < args.blocks; ++b) s = __fadd_rn(s, row[b]);
    }
  }
  args.out[t] = s;
}

}  // namespace

cudaError_t launch_backward(const BackwardArgs& a, cudaStream_t stream) {
  const Common& c = a.c;
  const bool glu = is_glu(c.kind);
  const int64_t w = glu ? 2 * c.ffn : c.ffn;
  const bool fp8 = has_fp8(a.dh_fp8) || a.dh_fp8.dbias_workspace != nullptr;
  if (c.rows < 0 || c.ffn < 0 || c.ffn % 16 != 0) return cudaErrorInvalidValue;
  if (!fp8_ok(a.dh_fp8, w)) return cudaErrorInvalidValue;
  if (fp8 && c.dtype != DType::kBFloat16) return cudaErrorInvalidValue;
  if (glu && has_fp8(a.dh_fp8) && c.ffn % kTile != 0) return cudaErrorInvalidValue;  // see activation.h
  if (c.rows == 0 || c.ffn == 0 || c.max_row_tiles == 0) return cudaSuccess;
  if (c.max_row_tiles * ceil_div<int64_t>(c.ffn, kTile) > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (fp8) return launch_kind<__nv_bfloat16, true>(a, stream);
  switch (c.dtype) {
    case DType::kBFloat16: return launch_kind<__nv_bfloat16, false>(a, stream);
    case DType::kFloat16: return launch_kind<__half, false>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_probs_grad(const ProbsGradArgs& a, cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(ceil_div<int64_t>(a.rows, kReduceThreads)));
  const bool vec4 = a.blocks % 4 == 0 && reinterpret_cast<uintptr_t>(a.partials) % 16 == 0;
  if (vec4) probs_grad_kernel<true><<<grid, kReduceThreads, 0, stream>>>(a);
  else probs_grad_kernel<false><<<grid, kReduceThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace activation
}  // namespace lpmoe
