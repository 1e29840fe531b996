// Host side of the wgrad kernel: template maps, configuration, the map
// launch and the GEMM launch.  No device value is read (capturable).
#include <climits>

#include "fp8_gemm/heuristics.h"
#include "fp8_gemm/tensor_map.h"
#include "fp8_gemm/wgrad.h"

namespace lpmoe {
namespace fp8_gemm {

namespace {

// The main_grad kernels have their own shared-memory plan, hence their own
// member-table limit (1567 groups at width 192 against 3311; 7643 at 128
// against 7403, one stage fewer leaving more room; 20 fewer each since the
// tile feed's ring, stop 56).
template <int BlockN>
bool wgrad_fits(int num_groups, bool fp32_accumulate) {
  const int limit = fp32_accumulate ? WgradLayout<BlockN, true>::max_groups() : WgradLayout<BlockN>::max_groups();
  return num_groups >= 1 && num_groups <= limit;
}

template <int BlockN, bool Fp32Accumulate>
cudaError_t launch_cluster(int cluster, const WgradParams& p, int grid, cudaStream_t stream) {
  return cluster == 2 ? launch_wgrad<BlockN, 2, Fp32Accumulate>(p, grid, stream)
                      : launch_wgrad<BlockN, 1, Fp32Accumulate>(p, grid, stream);
}

template <int BlockN>
cudaError_t launch_width(int cluster, bool fp32_accumulate, const WgradParams& p, int grid, cudaStream_t stream) {
  return fp32_accumulate ? launch_cluster<BlockN, true>(cluster, p, grid, stream)
                         : launch_cluster<BlockN, false>(cluster, p, grid, stream);
}

}  // namespace

bool wgrad_supports(BlockScaledConfig cfg, int num_groups, bool fp32_accumulate) {
  if (cfg.cluster != 0 && cfg.cluster != 1 && cfg.cluster != 2) return false;
  switch (cfg.block_n) {
    // Width left to run_wgrad: it takes the heuristic's width, or the other
    // one when that one's table is too small.
    case 0: return wgrad_fits<128>(num_groups, fp32_accumulate) || wgrad_fits<192>(num_groups, fp32_accumulate);
    case 128: return wgrad_fits<128>(num_groups, fp32_accumulate);
    case 192: return wgrad_fits<192>(num_groups, fp32_accumulate);
    default: return false;
  }
}

cudaError_t run_wgrad(const gemm::GroupedGemmArgs& args, int64_t token_capacity, BlockScaledConfig cfg,
                      BlockScaledConfig* ran, bool* bf16_tma_store) {
  *ran = BlockScaledConfig{};
  if (bf16_tma_store != nullptr) *bf16_tma_store = false;
  if (args.kind != gemm::GemmKind::kWgrad || (args.beta != 0.0f && args.beta != 1.0f)) return cudaErrorNotSupported;
  const int g = args.num_groups;
  const bool fp32_accumulate = wgrad_fp32_accumulate(args.beta, !args.wgrad_bf16);  // FP8: fp32 or bf16 out
  const BlockScaledConfig pick = choose_wgrad_config(args.k);
  if (cfg.cluster == 0) cfg.cluster = pick.cluster;
  if (cfg.block_n == 0) {  // the heuristic's width, else the one whose member table fits
    cfg.block_n = pick.block_n;
    if (!wgrad_supports(cfg, g, fp32_accumulate)) cfg.block_n = pick.block_n == 128 ? 192 : 128;
  }
  if (!wgrad_supports(cfg, g, fp32_accumulate)) return cudaErrorNotSupported;
  if (args.n > INT_MAX || args.k > INT_MAX || args.n % 16 != 0 || args.k % 16 != 0) return cudaErrorNotSupported;
  const int64_t m_tiles = (args.n + kBlockM * cfg.cluster - 1) / (kBlockM * cfg.cluster);
  const int64_t n_tiles = (args.k + cfg.block_n - 1) / cfg.block_n;
  if (m_tiles * n_tiles * g > INT_MAX / 2) return cudaErrorNotSupported;
  // The maps live at the start of the caller's workspace, 128-byte aligned,
  // the tile counter right after them.
  const uintptr_t ws = reinterpret_cast<uintptr_t>(args.workspace);
  const uintptr_t maps = (ws + 127) / 128 * 128;
  if (args.workspace == nullptr || args.workspace_bytes < wgrad_map_bytes(g)) return cudaErrorInvalidValue;
  // Templates: one 128-token block of dy^T (N rows) and x^T (K rows); the
  // device patches base, token extent and stride per member.  Without token
  // rows (every member empty: the kernel only writes zeros) the buffers may
  // have no address; the workspace stands in for a base the driver accepts.
  const void* a_base = args.a != nullptr ? args.a : args.workspace;
  const void* b_base = args.b != nullptr ? args.b : args.workspace;
  CUtensorMap a_template, b_template;
  if (!encode_kmajor_fp8_map(&a_template, 2, a_base, kBlockK, args.n, kBlockK, 1, 0, kBlockM) ||
      !encode_kmajor_fp8_map(&b_template, 2, b_base, kBlockK, args.k, kBlockK, 1, 0,
                             static_cast<uint32_t>(cfg.block_n / cfg.cluster))) {
    return cudaErrorNotSupported;
  }
  WgradParams p;
  p.pad128 = args.rows.pad128;
  p.num_groups = g;
  p.n_rows = static_cast<int>(args.n);
  p.k_cols = static_cast<int>(args.k);
  p.a_scale = args.a_scale;
  p.b_scale = args.b_scale;
  p.maps = reinterpret_cast<const CUtensorMap*>(maps);
  p.tile_counter = reinterpret_cast<int*>(maps + 2 * size_t(g) * sizeof(CUtensorMap));
  p.dynamic_tiles = fp32_accumulate && cfg.cluster == 1 && wgrad_dynamic_tiles(token_capacity, g) ? 1 : 0;
  p.d = args.d;
  p.out_bf16 = args.wgrad_bf16 ? 1 : 0;
  p.accumulate = args.beta != 0.0f ? 1 : 0;
  if (!p.out_bf16 && !encode_fp32_rows_map(&p.out_map, args.d, args.k, args.n, g, kWgradBoxCols, 16)) {
    return cudaErrorNotSupported;
  }
  // Fresh bf16 output through TMA stores where the driver takes the map
  // (else the staged stores, same bits).
  if (p.out_bf16 && !p.accumulate && args.d != nullptr &&
      encode_bf16_members_map(&p.out_map, args.d, args.k, args.n, g, kWgradStoreBoxCols, 16)) {
    p.out_bf16_tma = 1;
  }
  cudaError_t st = launch_wgrad_maps(a_template, b_template, a_base, b_base, p, args.stream);
  if (st != cudaSuccess) return st;
  const int64_t sm_ctas = args.sm_count / cfg.cluster * cfg.cluster;
  const int64_t max_ctas = m_tiles * n_tiles * g * cfg.cluster;
  const int grid = static_cast<int>(max_ctas < sm_ctas ? max_ctas : sm_ctas);
  st = cfg.block_n == 128 ? launch_width<128>(cfg.cluster, fp32_accumulate, p, grid, args.stream)
                          : launch_width<192>(cfg.cluster, fp32_accumulate, p, grid, args.stream);
  if (st == cudaSuccess) {
    *ran = cfg;
    if (bf16_tma_store != nullptr) *bf16_tma_store = p.out_bf16_tma != 0;
  }
  return st;
}

}  // namespace fp8_gemm
}  // namespace lpmoe
