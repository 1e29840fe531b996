// Host side of the block-scaled fprop/dgrad kernel: operand maps, tile-width
// choice and launch.  No device value is read (capturable).
#include <climits>

#include "fp8_gemm/block_scaled.h"
#include "fp8_gemm/heuristics.h"
#include "fp8_gemm/tensor_map.h"

namespace lpmoe {
namespace fp8_gemm {

namespace {

template <int BlockN>
bool fits(int num_groups) {
  return num_groups >= 1 && num_groups <= BlockScaledLayout<BlockN>::max_groups();
}

}  // namespace

bool block_scaled_supports(BlockScaledConfig cfg, int num_groups) {
  if (cfg.cluster != 0 && cfg.cluster != 1 && cfg.cluster != 2) return false;
  switch (cfg.block_n) {
    case 0: return fits<128>(num_groups) && fits<160>(num_groups) && fits<192>(num_groups);
    case 128: return fits<128>(num_groups);
    case 160: return fits<160>(num_groups);
    case 192: return fits<192>(num_groups);
    default: return false;
  }
}

namespace {

template <int BlockN>
cudaError_t launch_width(int cluster, const CUtensorMap& a, const CUtensorMap& b, const CUtensorMap& d,
                         const BlockScaledParams& p, int grid, cudaStream_t stream) {
  return cluster == 2 ? launch_block_scaled<BlockN, 2>(a, b, d, p, grid, stream)
                      : launch_block_scaled<BlockN, 1>(a, b, d, p, grid, stream);
}

}  // namespace

cudaError_t run_block_scaled(const gemm::GroupedGemmArgs& args, int64_t a_rows, BlockScaledConfig cfg,
                             BlockScaledConfig* ran) {
  *ran = BlockScaledConfig{};
  if (args.kind == gemm::GemmKind::kWgrad || args.b_ptrs != nullptr) return cudaErrorNotSupported;
  const bool fprop = args.kind == gemm::GemmKind::kFprop;
  const int64_t k_red = fprop ? args.k : args.n;
  const int64_t n_cols = fprop ? args.n : args.k;
  // fprop reads W (N, K); dgrad the transposed copy (K, round_up(N, 128)).
  const int64_t ldb = fprop ? args.k : (args.n + 127) / 128 * 128;
  const int g = args.num_groups;
  const BlockScaledConfig pick = choose_config(a_rows, g, n_cols, args.sm_count);
  if (cfg.block_n == 0) cfg.block_n = pick.block_n;
  if (cfg.cluster == 0) cfg.cluster = pick.cluster != 0 ? pick.cluster : 1;
  if (!block_scaled_supports(cfg, g)) return cudaErrorNotSupported;
  // int coordinates and the scheduler's int table (pad4 <= rows + 3 per group)
  if (a_rows + 4 * int64_t(g) > INT_MAX || n_cols > INT_MAX) return cudaErrorNotSupported;
  if ((k_red + kBlockK - 1) / kBlockK > kMaxKBlocks) return cudaErrorNotSupported;
  const int block_n = cfg.block_n;
  if (a_rows == 0) {  // no token rows: nothing to compute
    *ran = cfg;
    return cudaSuccess;
  }
  CUtensorMap map_a, map_b, map_d;
  // D has a_rows rows of n_cols (the binding checks its size); the map needs
  // a 16-byte aligned base and row pitch, as the kernel's 16-byte stores do.
  if (!encode_kmajor_fp8_map(&map_a, 2, args.a, k_red, a_rows, k_red, 1, 0, kBlockM) ||
      !encode_kmajor_fp8_map(&map_b, 3, args.b, k_red, n_cols, ldb, g, args.b_member_elems,
                             static_cast<uint32_t>(block_n / cfg.cluster)) ||
      !encode_bf16_rows_map(&map_d, args.d, n_cols, a_rows, kStoreBoxCols, 16)) {
    return cudaErrorNotSupported;
  }
  BlockScaledParams p;
  p.row = args.rows.row;
  p.pad4 = args.rows.pad4;
  p.num_groups = g;
  p.n_cols = static_cast<int>(n_cols);
  p.k_red = static_cast<int>(k_red);
  p.a_scale = args.a_scale;
  p.b_scale = args.b_scale;
  p.b_scale_member = args.b_scale_member_elems;
  p.b_scale_ld = static_cast<int>(((n_cols + 127) / 128 + 3) / 4 * 4);
  p.d = args.d;
  // Persistent grid: one CTA per SM (whole clusters), fewer when there are
  // fewer tiles.
  const int64_t cl = cfg.cluster;
  const int64_t n_tiles = (n_cols + block_n - 1) / block_n;
  const int64_t max_ctas = ((a_rows + kBlockM * cl - 1) / (kBlockM * cl) + g) * n_tiles * cl;
  const int64_t sm_ctas = args.sm_count / cl * cl;
  const int grid = static_cast<int>(max_ctas < sm_ctas ? max_ctas : sm_ctas);
  cudaError_t st = cudaSuccess;
  // This kernel has no argument-building launch to fold the tail into.
  if (args.zero_tail) {
    st = gemm::grouped_row_epilogue(args.d, nullptr, /*bf16*/ 0, args.rows, g, args.d_rows, n_cols, true,
                                    args.stream);
    if (st != cudaSuccess) return st;
  }
  switch (block_n) {
    case 128: st = launch_width<128>(cfg.cluster, map_a, map_b, map_d, p, grid, args.stream); break;
    case 160: st = launch_width<160>(cfg.cluster, map_a, map_b, map_d, p, grid, args.stream); break;
    default: st = launch_width<192>(cfg.cluster, map_a, map_b, map_d, p, grid, args.stream); break;
  }
  if (st == cudaSuccess) *ran = cfg;
  return st;
}

}  // namespace fp8_gemm
}  // namespace lpmoe
