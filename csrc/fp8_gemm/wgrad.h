// lpmoe's own FP8 block-scaled grouped GEMM for the weight gradient:
//
//   dW_t (N x K) = dy_t^T x_t,  both operands 1x128-scaled along the tokens
//
// read from the columnwise (transposed, per member 128-padded) copies of dy
// and x.  Parameters, shared-memory plan and launcher API (plain C++); the
// kernel is in wgrad_kernel.cuh.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "fp8_gemm/block_scaled.h"
#include "gemm/grouped_gemm.h"

namespace lpmoe {
namespace fp8_gemm {

struct WgradParams {
  const int64_t* pad128 = nullptr;  // G+1 prefix sums of round_up(M_t, 128)
  int num_groups = 0;
  int n_rows = 0;  // N: dW rows (dy's columns)
  int k_cols = 0;  // K: dW columns (x's columns)
  // The 1x128 scales of the columnwise copies: member t at
  // round_up(dim, 4) * pad128[t] / 128, laid out (ceil(M_t / 128) blocks, round_up(dim, 4)).
  const float* a_scale = nullptr;  // dy's, dim = N
  const float* b_scale = nullptr;  // x's, dim = K
  // Per-member TMA maps written on the device before the GEMM (the members'
  // token counts, hence their row strides, are device values): A of member t
  // at maps[2t], B at maps[2t + 1].
  const CUtensorMap* maps = nullptr;
  void* d = nullptr;  // (G, N, K), fp32 or bf16
  int out_bf16 = 0;
  int accumulate = 0;  // d += dy^T x (an empty member then leaves d alone)
  // 1: out_map is the bf16 map below and fresh bf16 output leaves through
  // TMA stores; 0: bf16 output takes the staged 16-byte stores (always when
  // accumulating, which reads the old values).
  int out_bf16_tma = 0;
  // A map over d as (K, N, G): fp32 with (32 x 16) boxes and 128-byte
  // swizzle, through which the epilogue stores; or, with out_bf16_tma, bf16
  // with (kWgradStoreBoxCols x 16) boxes and 128-byte swizzle (the strip of
  // write_bf16_strip).
  CUtensorMap out_map{};
  // 1: the main_grad kernel that takes its tiles from the counter
  // (tile_feed.cuh), in the workspace after the maps (the map launch zeroes
  // it); 0: round-robin.
  int dynamic_tiles = 0;
  int* tile_counter = nullptr;
};

// The dynamic tile feed (tile_feed.cuh): tiles the producer may publish
// ahead of the math warps, and the shared memory of that ring (a full and an
// empty barrier and a tile index per slot).
constexpr int kWgradFeedSlots = 4;
constexpr int kWgradFeedBytes = kWgradFeedSlots * (2 * 8 + 4);

// bf16 store box of the fresh-output TMA epilogue: 16 rows x 64 columns
// (128-byte rows; the fprop kernel's boxes have 64-byte rows).
constexpr int kWgradStoreBoxCols = 64;

// fp32 epilogue box of one math warp: its 16 rows x 32 columns (128-byte rows).
constexpr int kWgradBoxCols = 32;
constexpr int kWgradStagingBytes = 16 * kWgradBoxCols * 4;
static_assert(kWgradStagingBytes >= kEpilogueWarpBytes, "the bf16 staging tile fits the same buffer");

// Fp32Strip (the main_grad kernels): each math warp's staging holds its
// whole 16 x BlockN fp32 strip, so every old value of a tile can be copied in
// under the tile's K-blocks (wgrad_epilogues.cuh), at the price of one
// pipeline stage (3 at width 192, 4 at 128).
template <int BlockN, bool Fp32Strip = false>
struct WgradLayout {
  static_assert(BlockN % 16 == 0 && BlockN <= 256, "wgmma N");
  static constexpr int kABytes = kBlockM * kRowBytes;
  static constexpr int kBBytes = BlockN * kRowBytes;
  static constexpr int kStageBytes = kABytes + kBBytes;  // TMA tiles (multiples of 1024 bytes)
  static_assert(kStageBytes % 1024 == 0, "128-byte swizzled tiles need 1024-byte aligned stages");
  // A stage's scales: one per tile row (dy) and one per tile column (x).
  static constexpr int kScaleStageBytes = (kBlockM + BlockN) * 4;
  // Output staging, one buffer per math warp (1024-byte aligned: the boxes
  // are swizzled): the warp's whole 16 x BlockN bf16 strip, which TMA stores
  // read while the warp goes on to the next tile (a member of 512 tokens
  // gives a tile only 4 K-blocks, and the staged stores took a third of the
  // math warps' time there, docs/fp8-wgrad-kernel-notes.md stop 52); the
  // fp32 path's 2 KB boxes and the staged bf16 path use the same area.
  static constexpr int kWarpEpilogueBytes =
      Fp32Strip ? 16 * BlockN * 4 : (16 * BlockN * 2 > kWgradStagingBytes ? 16 * BlockN * 2 : kWgradStagingBytes);
  static_assert(kWarpEpilogueBytes % 1024 == 0, "swizzled boxes need 1 KB alignment");
  // fp32 boxes the staging area holds, used in turn (3 at width 192, 2 at
  // 128; with Fp32Strip the strip's 6 / 4).
  static constexpr int kFp32Boxes = kWarpEpilogueBytes / kWgradStagingBytes;
  static constexpr int kEpilogueBytes = 8 * kWarpEpilogueBytes;
  // Reserve 1 KB alignment slack, the staging and 2 KB for the barriers and
  // the member table (thousands of groups fit in what the stages leave
  // over); the rest is pipeline stages (4 at width 192, 5 at 128; with
  // Fp32Strip 3 and 4).
  static constexpr int kStages =
      (kSmemLimit - 1024 - kEpilogueBytes - 2048) / (kStageBytes + kScaleStageBytes);
  static_assert(kStages >= 3, "too few stages");
  static constexpr int kEpilogueOffset = kStages * kStageBytes;
  static constexpr int kScaleOffset = kEpilogueOffset + kEpilogueBytes;
  static constexpr int kBarOffset = kScaleOffset + kStages * kScaleStageBytes;
  // The tile feed's ring (tile_feed.cuh), in the main_grad plan only (its
  // cluster-1 kernels may take tiles from the counter).
  static constexpr int kFeedOffset = kBarOffset + 2 * kStages * 8;
  static constexpr int kTableOffset = kFeedOffset + (Fp32Strip ? kWgradFeedBytes : 0);
  // The table: each member's first 128-token block (G+1 ints).
  static constexpr size_t smem_bytes(int groups) { return 1024 + kTableOffset + 4 * (size_t(groups) + 1); }
  static constexpr int max_groups() { return (kSmemLimit - 1024 - kTableOffset) / 4 - 1; }
};

// Tile widths this build instantiates for wgrad (clusters 1 and 2).
constexpr int kWgradBlockNs[] = {128, 192};

// Bytes of the GEMM workspace the per-member maps (128-byte aligned inside
// it) and, after them, the tile feed's counter need.
inline size_t wgrad_map_bytes(int num_groups) { return 128 + 2 * size_t(num_groups) * sizeof(CUtensorMap) + 128; }

// Fp32Accumulate: the fp32-output, beta = 1 (main_grad) kernel; every other
// output runs the other one.
template <int BlockN, int Cluster, bool Fp32Accumulate>
cudaError_t launch_wgrad(const WgradParams& p, int grid, cudaStream_t stream);

// Writes the per-member maps of `p` from the two templates (whose box,
// swizzle and outer dims are final; the token dim, its stride and the base
// are patched per member).
cudaError_t launch_wgrad_maps(const CUtensorMap& a_template, const CUtensorMap& b_template, const void* a,
                              const void* b, const WgradParams& p, cudaStream_t stream);

// Whether a call runs the main_grad kernels: it adds (beta != 0) into an
// fp32 output.  The binding and run_wgrad both ask, so the answer is here once.
constexpr bool wgrad_fp32_accumulate(double beta, bool out_fp32) { return beta != 0.0 && out_fp32; }

// Whether the kernels of `cfg` run `num_groups` members (their member table
// fits); fp32_accumulate: the main_grad kernels (wgrad_fp32_accumulate).
bool wgrad_supports(BlockScaledConfig cfg, int num_groups, bool fp32_accumulate);

// wgrad with the given configuration (zeros: the heuristic's choice, or the
// other width when the chosen one's member table does not fit);
// cudaErrorNotSupported when the call does not fit (too many groups, beta
// other than 0 or 1, sizes past int, a map the driver rejects: the binding
// then runs the CUTLASS kernel).  *ran = the configuration that ran;
// *bf16_tma_store (if given) = whether a bf16 output left through the TMA
// strip epilogue (else the staged stores: accumulation, or a map the driver
// refused).
// token_capacity: the tokens the columnwise operands have room for (a host
// bound on the routed total, which the main_grad kernels' tile order reads).
cudaError_t run_wgrad(const gemm::GroupedGemmArgs& args, int64_t token_capacity, BlockScaledConfig cfg,
                      BlockScaledConfig* ran, bool* bf16_tma_store = nullptr);

}  // namespace fp8_gemm
}  // namespace lpmoe
