// lpmoe's own FP8 block-scaled grouped GEMM (fprop / dgrad: 1x128 token
// operand x 128x128 weights -> bf16): parameters, shared-memory plan and
// launchers.  Plain C++ header: the binding's dispatcher includes it; the
// kernel is in kernel_1x128_128x128.cuh, one translation unit per tile width.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "gemm/grouped_gemm.h"

namespace lpmoe {
namespace fp8_gemm {

constexpr int kBlockK = 128;        // K per pipeline stage: one scale block
constexpr int kRowBytes = kBlockK;  // FP8 operand rows in shared memory

struct BlockScaledParams {
  const int64_t* row = nullptr;   // G+1 token prefix sums
  const int64_t* pad4 = nullptr;  // G+1 prefix sums of round_up(M_t, 4)
  int num_groups = 0;
  int n_cols = 0;  // output columns: N (fprop) or K (dgrad)
  int k_red = 0;   // contraction: K (fprop) or N (dgrad)
  // A's 1x128 scales: member t at ceil(k_red/128) * pad4[t], laid out
  // (ceil(k_red/128), round_up(M_t, 4)) (M-major).
  const float* a_scale = nullptr;
  // B's 128x128 scales: member t at t * b_scale_member, laid out
  // (ceil(k_red/128), b_scale_ld) with b_scale_ld = round_up(ceil(n_cols/128), 4).
  const float* b_scale = nullptr;
  int64_t b_scale_member = 0;
  int b_scale_ld = 0;
  void* d = nullptr;  // bf16 (rows, n_cols) row-major
};

constexpr int kBlockM = 128;  // token rows per CTA tile (two math warpgroups x 64)
constexpr int kMaxKBlocks = 256;  // contraction up to 32768 (B scales of a tile live in shared memory)
constexpr int kBandRowTiles = 16;  // 128-row tiles per scheduler band (tile_scheduler.cuh)
// Epilogue staging: a math warp's 16 output rows leave kEpilogueCols columns
// at a time through shared memory, so each lane stores 16 contiguous bytes
// (the wgmma fragment spreads a row's 4-byte pairs over four lanes).  Rows are
// 32 data bytes + 16 pad bytes: the fragment's 4-byte writes hit 32 distinct
// banks.
constexpr int kEpilogueCols = 16;
constexpr int kEpilogueRowBytes = 48;
constexpr int kEpilogueWarpBytes = 16 * kEpilogueRowBytes;
// The TMA-store epilogue: a math warp whose 16 rows are all inside the group
// writes its 16 x BlockN bf16 strip into shared memory as boxes of 16 rows x
// kStoreBoxCols columns (64-byte rows, 64-byte swizzle: the fragment's 4-byte
// writes hit 32 distinct banks) and hands them to bulk tensor stores; the
// stores drain while the warp goes on to the next tile, and the strip is
// rewritten only after they have read it (a tile later).
constexpr int kStoreBoxCols = 32;
// Bytes of one 16-row bf16 store box (1 KB at kStoreBoxCols: 1024-byte aligned).
constexpr int store_box_bytes(int box_cols) { return 16 * box_cols * 2; }
constexpr int kSmemLimit = 232448;  // sm_90 opt-in dynamic shared memory per block

template <int BlockN>
struct BlockScaledLayout {
  static_assert(BlockN % 16 == 0 && BlockN <= 256, "wgmma N");
  // A tile starting at a multiple of BlockN spans at most two 128-column
  // weight-scale blocks: the largest start offset inside a block is
  // 128 - gcd(BlockN, 128).
  static constexpr int gcd128(int a) { return a % 128 == 0 ? 128 : (a % 64 == 0 ? 64 : (a % 32 == 0 ? 32 : 16)); }
  static_assert(128 - gcd128(BlockN) + BlockN <= 256, "tile would span three 128-column scale blocks");
  static constexpr int kABytes = kBlockM * kRowBytes;
  static constexpr int kBBytes = BlockN * kRowBytes;
  static constexpr int kStageBytes = kABytes + kBBytes;         // TMA tiles
  static_assert(kStageBytes % 1024 == 0, "128-byte swizzled tiles and the strips after the stages need 1 KB alignment");
  static constexpr int kAScaleStageBytes = kBlockM * 4;         // A's scales per stage
  static constexpr int kBScaleBytes = 2 * 2 * kMaxKBlocks * 4;  // per math warpgroup: two scale blocks
  // One strip per math warp (whole boxes); the masked path (warps that
  // straddle the group's end) stages through the first kEpilogueWarpBytes.
  static_assert(BlockN % kStoreBoxCols == 0, "whole store boxes");
  static constexpr int kStripBytes = 16 * BlockN * 2;
  static constexpr int kEpilogueBytes = 8 * kStripBytes;
  // Reserve 1 KB alignment slack, the B scales, the strips and 8 KB for
  // barriers and the scheduler's tile table; the rest holds pipeline stages,
  // at most 4 (every width fits 4; 5 measured no faster at the anchor shape,
  // docs/fp8-gemm-kernel-notes.md).  The math warps take whole ring turns
  // per tile and the last turn's unused stages cost a barrier round trip
  // each, so a ring of 4 matches K-block counts of common K (multiples of
  // 512) with no padding.
  static constexpr int kStagesFit =
      (kSmemLimit - 1024 - kBScaleBytes - kEpilogueBytes - 8192) / (kStageBytes + kAScaleStageBytes);
  static constexpr int kStages = kStagesFit < 4 ? kStagesFit : 4;
  static_assert(kStages >= 3, "too few stages");
  static constexpr int kEpilogueOffset = kStages * kStageBytes;  // 1024-aligned: stages are whole KBs
  static constexpr int kAScaleOffset = kEpilogueOffset + kEpilogueBytes;
  static constexpr int kBScaleOffset = kAScaleOffset + kStages * kAScaleStageBytes;
  static constexpr int kBarOffset = kBScaleOffset + kBScaleBytes;
  static constexpr int kTableOffset = kBarOffset + 2 * kStages * 8;
  // The scheduler's table: 12 bytes per group (tile_scheduler.cuh).
  static constexpr size_t smem_bytes(int groups) { return 1024 + kTableOffset + 4 * (3 * size_t(groups) + 2); }
  static constexpr int max_groups() { return ((kSmemLimit - 1024 - kTableOffset) / 4 - 2) / 3; }
};

// Tile widths this build instantiates (one translation unit each, with
// clusters of 1 and 2 CTAs along M; 2: the B tile is multicast).
constexpr int kBlockNs[] = {128, 160, 192};

struct BlockScaledConfig {
  int block_n = 0;  // 0: the heuristic's choice; -1 (pinned by a caller): the CUTLASS kernel
  int cluster = 0;  // 0: the heuristic's choice
};

// Launches one configuration (block_scaled_n<N>.cu); `grid` is a multiple
// of Cluster.  The B map's box is BlockN / Cluster rows.
// `d` is the TMA-store map over the bf16 output (encode_bf16_rows_map).
template <int BlockN, int Cluster>
cudaError_t launch_block_scaled(const CUtensorMap& a, const CUtensorMap& b, const CUtensorMap& d,
                                const BlockScaledParams& p, int grid, cudaStream_t stream);

// Whether the configuration exists and the group table fits its shared
// memory (values 0 = any).
bool block_scaled_supports(BlockScaledConfig cfg, int num_groups);

// fprop / dgrad with the given configuration (zeros filled in by the
// heuristic, heuristics.h; cudaErrorNotSupported when the call does not fit
// this kernel: the binding then runs the CUTLASS kernel).  `a_rows` = rows of the token operand buffer
// (TMA bounds).  *ran = the configuration that ran ({0, 0} if none).
cudaError_t run_block_scaled(const gemm::GroupedGemmArgs& args, int64_t a_rows, BlockScaledConfig cfg,
                             BlockScaledConfig* ran);

}  // namespace fp8_gemm
}  // namespace lpmoe
