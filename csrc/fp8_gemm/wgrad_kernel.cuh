// FP8 block-scaled grouped GEMM for the weight gradient (wgrad.h):
//
//   dW_t[n, k] = sum_kb  sA[n, kb] * sB[k, kb] * sum_{tokens in kb} dy_t[tok, n] x_t[tok, k]
//
// The contraction runs over a member's tokens, so both operands carry a scale
// per row *and* per 128-token block: the promotion multiplies each fragment by
// a row scale and a column scale (two fp32 ops per value instead of fprop's
// one).  The skeleton is the fprop kernel's (kernel_1x128_128x128.cuh): one
// CTA per SM, a TMA producer warpgroup, two math warpgroups of 64 rows,
// optional 2-CTA cluster that multicasts the x^T tile.  What differs:
// * Operand maps are per member (the columnwise copies store member t as an
//   (N or K) x round_up(M_t, 128) block whose row stride is a device value);
//   a small launch writes them before this kernel (wgrad_maps.cu) and the
//   producer acquires a member's maps when it reaches the member.
// * Both scale vectors of a K-block (128 row scales of dy, BlockN column
//   scales of x) are contiguous runs, bulk-copied into the stage with the
//   tiles; the math warps read their two row scales before the wgmmas and
//   the column scales in the promotion after them, and release the stage
//   once the next K-block's wgmmas are issued.
// * Every member has the same tiles, with a member-dependent number of
//   K-blocks; an empty member's tiles store zeros (or leave an accumulated
//   output alone), so no separate zeroing launch exists.  Tiles go out
//   round-robin, or (DynamicTiles: main_grad calls with short members) from
//   a global counter as CTAs free up (tile_feed.cuh).
// * Math warpgroup 1 runs half a tile (at most kLead K-blocks) behind
//   warpgroup 0 (below), so their epilogues do not fall on the same cycles.
// * The fp32 epilogue goes out through TMA stores of per-warp 16 x 32 boxes
//   (accumulation first brings the old values in, by cp.async under the
//   tile's K-blocks, into a staging area that holds the warp's whole strip,
//   in the main_grad instantiation below); fresh bf16 through
//   TMA stores of the warp's whole strip, as fprop's; accumulated bf16
//   (which reads the old values) through the per-warp staging tile and
//   16-byte stores.
#pragma once

#include "fp8_gemm/math_warpgroup.cuh"
#include "fp8_gemm/sm90_primitives.cuh"
#include "fp8_gemm/tile_feed.cuh"
#include "fp8_gemm/tile_scheduler.cuh"
#include "fp8_gemm/wgrad.h"
#include "fp8_gemm/wgrad_epilogues.cuh"

namespace lpmoe {
namespace fp8_gemm {

// res += acc * sa_row * sb_col for one K-block.  `sb` points at this
// thread's first column pair in the stage's column scales.
template <int BlockN>
__device__ __forceinline__ void promote_outer(float* res, const float* acc, float sa0, float sa1, const float* sb) {
#pragma unroll
  for (int j = 0; j < BlockN / 8; ++j) {
    const float2 s = *reinterpret_cast<const float2*>(sb + 8 * j);
    res[4 * j + 0] = fmaf(acc[4 * j + 0], sa0 * s.x, res[4 * j + 0]);
    res[4 * j + 1] = fmaf(acc[4 * j + 1], sa0 * s.y, res[4 * j + 1]);
    res[4 * j + 2] = fmaf(acc[4 * j + 2], sa1 * s.x, res[4 * j + 2]);
    res[4 * j + 3] = fmaf(acc[4 * j + 3], sa1 * s.y, res[4 * j + 3]);
  }
}

// Math warpgroup 1 starts each tile only after warpgroup 0 has finished
// that tile's first `lead` K-blocks, lead = min(kLead, K-blocks / 2) (named
// barrier kLeadBarrier: warpgroup 0 arrives, warpgroup 1 waits).  The two
// would otherwise run in lock step, and at 512 tokens per member (4 K-blocks
// a tile) both would write their epilogue while the tensor pipe idles; held
// half a tile apart, each one's epilogue runs under the other's last
// K-blocks (the 32 x 16k MLP step's wgrad kernels: 1.97-2.02 -> 1.80-1.82
// ms, H100; a fixed lead of 3 measured the same, 4 (whole tiles in turn)
// 1.84-1.86; long members unchanged).  Half a tile, not a fixed 2: with 31
// members of 256 tokens (2-K-block tiles) a fixed 2 ran 2-8 % slower than
// no lead, half a tile 8-10 % faster than the fixed 2.  Warpgroup 0 can
// never arrive for a later tile before warpgroup 1 has passed this one's
// wait: that arrival needs stages which warpgroup 1 releases only after it,
// because every tile starts at ring stage 0 (ring_turns).  A ring that went
// on across tiles broke this and hung at 2-K-block tiles (stop 55,
// docs/grouped-mlp-notes.md; test_gpu_wgrad_two_kblock_tiles_many_per_cta).
// Both derive `lead` from the tile's K-block count; tiles of one or none
// (empty members, members of 1-128 tokens) skip both sides.
constexpr int kLead = 2;
constexpr int kLeadBarrier = 1;  // NamedBarrier's id (CUTLASS offsets it past its reserved ids)

// Fp32Accumulate: the instantiation for fp32 output added to the old values
// (main_grad), the one epilogue that reads the output under the K loop, with
// its own shared-memory plan (WgradLayout's Fp32Strip: staging for the whole
// strip, one stage fewer); every other output shares the other
// instantiation, which carries none of that code (with both in one kernel
// behind a runtime flag, fresh bf16 calls measured 3-7 % slower, stop 54).
template <int BlockN, int Cluster, bool Fp32Accumulate, bool DynamicTiles>
__device__ __forceinline__ void wgrad_math(const WgradParams& p, const WgradTileOrder<kBandRowTiles / Cluster>& order,
                                           const int* first_block, uint8_t* smem, uint64_t* full, uint64_t* empty,
                                           int rank, WgradTileFeed<DynamicTiles>& feed, int first_tile, int total) {
#if LPMOE_SM90A_DEVICE
  using L = WgradLayout<BlockN, Fp32Accumulate>;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int wg = warp_uniform(threadIdx.x / 128);
  cutlass::arch::warpgroup_reg_alloc<kWgradRegs.math>();
  // Fragment of a 64 x BlockN wgmma tile: thread (warp w, lane l) holds rows
  // 16w + l/4 and +8, columns 8j + 2(l%4) + {0,1}.
  const int w_in_wg = warp % 4;
  const int row_in_tile = wg * 64 + w_in_wg * 16 + lane / 4;
  const int col_in_frag = 2 * (lane % 4);
  uint8_t* stage_out = smem + L::kEpilogueOffset + warp * L::kWarpEpilogueBytes;
  float acc[BlockN / 2];
  float res[BlockN / 2];
  constexpr int kStages = L::kStages;
  uint32_t phase = 0;  // of the full barriers, flipped once per ring turn
  int lead = 0;        // this tile's K-blocks between the warpgroups (kLead above)
  // One K-block on stage s (a compile-time index once unrolled).  A stage
  // may go back only once every shared-memory read of it has returned.  The
  // wgmmas' reads end at their wait and the row scales are read before them,
  // but the column scales are read in the promotion after them, and ptxas
  // issued the last of those loads (tile columns 128-191 at width 192) right
  // before an arrive placed after the promotion, using them after it.  An
  // arrive does not wait for loads in flight: with accumulation's cp.async
  // copies competing for shared memory, a load still queued when the
  // producer refilled the stage read the next K-block's scales (whole
  // columns of a warpgroup off by about one K-block, a different few every
  // run; stop 54, fenced on that path only at first).  So a stage goes back
  // one K-block later, once the next K-block's wgmmas are issued: they
  // overwrite `acc`, which every promotion FFMA reads beside a product of
  // the loaded scales, so in-order issue has put every scale load of the
  // stage behind us, on every path, without a fence.  The tile's last
  // K-block has no successor in the tile; its stage goes back after the
  // walk, behind a CTA fence (once per tile; a fence per K-block cost long
  // members 5-10 %, and releasing it from inside `kblock` under a runtime
  // test spilled the accumulating width-192 kernel).  release_stage (a warp
  // barrier, then lane 0 arrives for the warp) also orders the other lanes'
  // reads before the arrive in the PTX memory model.  The SASS was checked
  // for the order (the arrive between the last QGMMA and the wgmma wait) in
  // the width-192 cluster-1 kernels; ptxas could in principle copy `acc` to
  // other registers and break the chain, which a change of this loop should
  // look for again.
  auto kblock = [&](int s, int kb) {
    Barrier::wait(&full[s], phase);
    const uint8_t* st = smem + s * L::kStageBytes;
    const float* sc = reinterpret_cast<const float*>(smem + L::kScaleOffset + s * L::kScaleStageBytes);
    // Row scales past N are stale and their rows dropped; likewise columns.
    const float sa0 = sc[row_in_tile], sa1 = sc[row_in_tile + 8];
    kblock_wgmma_issue<BlockN>(sw128_kmajor_desc(st + wg * 64 * kRowBytes), sw128_kmajor_desc(st + L::kABytes), acc);
    if (kb > 0) release_stage<Cluster>(&empty[(s + kStages - 1) % kStages], lane);
    kblock_wgmma_wait<BlockN>(acc);
    promote_outer<BlockN>(res, acc, sa0, sa1, sc + kBlockM + col_in_frag);
    if (wg == 0 && kb == lead - 1) cutlass::arch::NamedBarrier::arrive(256, kLeadBarrier);
  };
  for (int tile = feed.first(first_tile, lane); tile < total; tile = feed.next(tile, lane)) {
    const WgradTile t = order.locate(tile);
    const int nkb = first_block[t.group + 1] - first_block[t.group];
    if (nkb == 0 && p.accumulate) continue;  // nothing to add
    const int n0 = (t.m_block * Cluster + rank) * kBlockM;
    const int k0 = t.n_block * BlockN;
    if constexpr (Fp32Accumulate) {
      load_old_values<BlockN, L::kFp32Boxes>(p, stage_out, t.group, n0 + wg * 64 + w_in_wg * 16, k0, lane);
    }
#pragma unroll
    for (int i = 0; i < BlockN / 2; ++i) res[i] = 0.0f;
    lead = min(kLead, nkb / 2);  // kLead above
    if (wg == 1 && lead > 0) cutlass::arch::NamedBarrier::sync(256, kLeadBarrier);

    // Whole ring turns from stage 0, as in the fprop kernel; the producer
    // pads a partial last turn with stages that carry no data.  No __trap
    // or other exit may sit on this path (it costs the loop setmaxnreg's
    // registers, kernel_1x128_128x128.cuh).
    ring_turns<kStages>(nkb, phase, kblock, [&](int s) {  // a padding stage: no data
      Barrier::wait(&full[s], phase);
      release_stage<Cluster>(&empty[s], lane);
    });
    if (nkb > 0) {  // the last K-block's stage (kblock's comment)
      __threadfence_block();
      release_stage<Cluster>(&empty[(nkb - 1) % kStages], lane);
    }

    const int64_t member = int64_t(t.group) * p.n_rows * p.k_cols;
    const int warp_row0 = n0 + wg * 64 + w_in_wg * 16;
    if constexpr (Fp32Accumulate) {
      accumulate_fp32_tma<BlockN, L::kFp32Boxes>(p, res, t.group, warp_row0, k0, lane, stage_out);
    } else if (p.out_bf16_tma) {
      store_bf16_tma<BlockN>(p, res, t.group, warp_row0, k0, lane, stage_out);
    } else if (p.out_bf16) {
      store_bf16<BlockN>(p, static_cast<__nv_bfloat16*>(p.d) + member, res, warp_row0, k0, lane, stage_out,
                         p.accumulate != 0);
    } else {
      store_fp32_tma<BlockN, L::kFp32Boxes>(p, res, t.group, warp_row0, k0, lane, stage_out);
    }
  }
  if (lane == 0) cute::tma_store_wait<0>();  // the last boxes are read before the CTA's memory goes
#endif
}

// DynamicTiles: tiles from the global counter (tile_feed.cuh; main_grad,
// cluster 1, chosen per call by run_wgrad), else round-robin.
template <int BlockN, int Cluster, bool Fp32Accumulate, bool DynamicTiles>
__global__ void __launch_bounds__(384, 1) fp8_block_wgrad_kernel(const __grid_constant__ WgradParams p) {
  static_assert(!DynamicTiles || Cluster == 1, "a cluster's CTAs must take the same tiles");
#if LPMOE_SM90A_DEVICE
  using L = WgradLayout<BlockN, Fp32Accumulate>;
  constexpr int kStages = L::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (cute::cast_smem_ptr_to_uint(smem_raw) & 1023)) & 1023);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarOffset);
  uint64_t* empty = full + kStages;
  int* first_block = reinterpret_cast<int*>(smem + L::kTableOffset);  // member t's first 128-token block
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int wg = warp_uniform(threadIdx.x / 128);
  static_assert(Cluster == 1 || Cluster == 2, "cluster of 1 or 2 CTAs along N");
  const int rank = Cluster == 1 ? 0 : static_cast<int>(cute::block_rank_in_cluster());

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&full[s], 1);
      Barrier::init(&empty[s], 8 * Cluster);  // one arrive per math warp of each CTA
    }
    if constexpr (DynamicTiles) WgradTileFeed<true>::init(smem + L::kFeedOffset);
    cutlass::arch::fence_barrier_init();
  }
  if (warp == 0) {
    for (int g = lane; g <= p.num_groups; g += 32) first_block[g] = static_cast<int>(p.pad128[g] / kBlockK);
  }
  __syncthreads();
  if constexpr (Cluster > 1) cute::cluster_sync();  // partner's barriers exist before any multicast

  const WgradTileOrder<kBandRowTiles / Cluster> order{(p.n_rows + kBlockM * Cluster - 1) / (kBlockM * Cluster),
                                                       (p.k_cols + BlockN - 1) / BlockN};
  const int total = order.per_member() * p.num_groups;
  const int first_tile = blockIdx.x / Cluster;
  WgradTileFeed<DynamicTiles> feed{static_cast<int>(gridDim.x / Cluster)};
  if constexpr (DynamicTiles) {
    feed.counter = p.tile_counter;
    feed.smem = smem + L::kFeedOffset;
  }

  if (wg == 2) {
    cutlass::arch::warpgroup_reg_dealloc<kWgradRegs.producer>();
    if (threadIdx.x == 256) {
      constexpr int kBRows = BlockN / Cluster;  // x^T rows this CTA loads (and multicasts)
      const int64_t a_ld = (p.n_rows + 3) / 4 * 4;
      const int64_t b_ld = (p.k_cols + 3) / 4 * 4;
      int member = -1;
      RingPos<kStages> pos;
      // In the DynamicTiles kernel the math warps learn each tile from the
      // feed, the end included; in the others publish does nothing.
      feed.publish(first_tile);
      for (int tile = first_tile, next; tile < total; feed.publish(tile = next)) {
        next = feed.claim(tile);  // before the loads, which hide its latency
        const WgradTile t = order.locate(tile);
        const int kb0 = first_block[t.group];
        const int nkb = first_block[t.group + 1] - kb0;
        if (nkb == 0) continue;
        const CUtensorMap* map_a = p.maps + 2 * t.group;
        const CUtensorMap* map_b = map_a + 1;
        if (t.group != member) {
          // The maps were written by the previous launch through the generic
          // proxy; the TMA unit must not use a stale cached copy.
          asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(map_a) : "memory");
          asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(map_b) : "memory");
          member = t.group;
        }
        const int n0 = (t.m_block * Cluster + rank) * kBlockM;
        const int k0 = t.n_block * BlockN;
        // Scale runs: this tile's rows of dy and columns of x, in whole
        // 16-byte units inside the padded (round_up(dim, 4)) layouts.
        const uint32_t sa_bytes = n0 < p.n_rows ? static_cast<uint32_t>((min(kBlockM, p.n_rows - n0) + 3) / 4 * 16) : 0u;
        const uint32_t sb_bytes = static_cast<uint32_t>((min(BlockN, p.k_cols - k0) + 3) / 4 * 16);
        const float* as = p.a_scale + a_ld * kb0 + n0;
        const float* bs = p.b_scale + b_ld * kb0 + k0;
        // Whole ring turns per tile, as the math warps consume them: the
        // last turn's stages past nkb get an arrival without data.
        for (int kb = 0; kb < ring_slots<kStages>(nkb); ++kb) {
          Barrier::wait(&empty[pos.stage], pos.phase ^ 1u);
          if (kb >= nkb) {
            Barrier::arrive(&full[pos.stage]);
            pos.next();
            continue;
          }
          uint8_t* st = smem + pos.stage * L::kStageBytes;
          uint8_t* sc = smem + L::kScaleOffset + pos.stage * L::kScaleStageBytes;
          TxBarrier::arrive_and_expect_tx(&full[pos.stage], L::kStageBytes + sa_bytes + sb_bytes);
          tma_load_2d(map_a, &full[pos.stage], st, kb * kBlockK, n0);
          if (sa_bytes != 0) bulk_load(&full[pos.stage], sc, as + kb * a_ld, sa_bytes);
          bulk_load(&full[pos.stage], sc + kBlockM * 4, bs + kb * b_ld, sb_bytes);
          uint8_t* sb = st + L::kABytes + rank * kBRows * kRowBytes;
          if constexpr (Cluster == 1) {
            tma_load_2d(map_b, &full[pos.stage], sb, kb * kBlockK, k0);
          } else {
            tma_load_2d_multicast(map_b, &full[pos.stage], (1u << Cluster) - 1u, sb, kb * kBlockK, k0 + rank * kBRows);
          }
          pos.next();
        }
      }
    }
  } else {
    wgrad_math<BlockN, Cluster, Fp32Accumulate, DynamicTiles>(p, order, first_block, smem, full, empty, rank, feed,
                                                              first_tile, total);
  }
  if constexpr (Cluster > 1) cute::cluster_sync();
#else
  __trap();
#endif
}

}  // namespace fp8_gemm
}  // namespace lpmoe
