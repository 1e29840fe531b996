// FP8 block-scaled grouped GEMM for fprop and dgrad: A = token rows, 1x128
// scaled (one fp32 scale per row per 128 of K); B = the expert's weight,
// 128x128 scaled; D = bf16 token rows.  Both operands are K-major.
//
//   D[r, c] = sum_kb  sA[r, kb] * sB[c/128, kb] * sum_{k in kb} A[r, k] B[c, k]
//
// Design (Hopper, one CTA per SM, persistent):
// * warpgroup 2 is the producer: one thread streams A (128 x 128) and B
//   (BlockN x 128) tiles of each K-block through a Stages-deep ring with TMA
//   (one 2-D map over all token rows, one 3-D map over the experts' weights,
//   so no per-group descriptors exist and nothing is built per launch on the
//   device).
// * Cluster = 2: the two CTAs of a cluster take adjacent 128-row tiles of the
//   same group and weight columns; each loads half of the B tile and
//   multicasts it to both, so a CTA pulls 16 + BlockN*64 bytes of L2 per
//   K-row instead of 16 + BlockN*128 (without it the kernel is L2-bandwidth
//   bound: measured TFLOP/s tracked bytes per FLOP across tile widths).  A
//   stage is reused only when the consumers of *both* CTAs released it (each
//   math warp arrives on both CTAs' empty barriers).
// * warpgroups 0 and 1 each own 64 rows of the 128-row tile.  Per K-block a
//   warpgroup issues four 64 x BlockN x 32 wgmmas into a scratch accumulator,
//   then promotes it into the fp32 result with the two scales (scale products
//   in registers).  One warpgroup's promotion overlaps the other's wgmmas.
// * Every tile starts at ring stage 0 and takes whole ring turns (the
//   producer pads a partial last turn with stages that carry no data), so
//   the K loop is unrolled over the stages with compile-time barrier, scale
//   and descriptor offsets, and its body has no branch or warp barrier:
//   compute-only at base clocks, 5-13 % fewer cycles than with the stage in
//   a register (docs/fp8-gemm-kernel-notes.md, stop 34).
// * BlockN need not divide 128: a tile spans at most two 128-column weight
//   blocks (static_assert below), and each 8-column fragment picks its scale.
// * Epilogue: a math warp whose 16 rows are inside the group writes them to
//   its shared-memory strip and hands them to TMA stores, which drain while
//   the warp starts the next tile (store_strip_tma).  Rows past the group's
//   M_t belong to the next group (the 2-D A map reads through group
//   boundaries; those rows are computed and dropped), so the warp that
//   straddles the group's end stores through a masked staged path instead.
//   Columns past N are TMA zero fill on the loads and clipped on the stores.
//   The producer is already loading the next tile meanwhile.
#pragma once

#include <cuda_bf16.h>

#include <type_traits>

#include "fp8_gemm/block_scaled.h"
#include "fp8_gemm/math_warpgroup.cuh"
#include "fp8_gemm/sm90_primitives.cuh"
#include "fp8_gemm/tile_scheduler.cuh"

namespace lpmoe {
namespace fp8_gemm {

// res += acc * scale, per 8-column fragment j: rows r / r+8 take s?0 before
// tile column Split (first column of the second weight-scale block) and s?1
// from it on.  Split is a template argument so the choice costs nothing.
template <int BlockN, int Split>
__device__ __forceinline__ void promote(float* res, const float* acc, float s00, float s01, float s10, float s11) {
#pragma unroll
  for (int j = 0; j < BlockN / 8; ++j) {
    const float x0 = 8 * j >= Split ? s01 : s00;
    const float x1 = 8 * j >= Split ? s11 : s10;
    res[4 * j + 0] = fmaf(acc[4 * j + 0], x0, res[4 * j + 0]);
    res[4 * j + 1] = fmaf(acc[4 * j + 1], x0, res[4 * j + 1]);
    res[4 * j + 2] = fmaf(acc[4 * j + 2], x1, res[4 * j + 2]);
    res[4 * j + 3] = fmaf(acc[4 * j + 3], x1, res[4 * j + 3]);
  }
}

// The runtime split of a tile (128 - n0 % 128) is one of 128, 128 - G, ...,
// G with G = gcd(BlockN, 128): f(integral_constant<int, split>) runs the
// tile's K loop with the split known at compile time (one loop per value,
// chosen once per tile rather than per K-block).
template <int BlockN, int Split = 128, class F>
__device__ __forceinline__ void split_dispatch(int split, F&& f) {
  constexpr int kStep = BlockScaledLayout<BlockN>::gcd128(BlockN);
  if constexpr (Split - kStep <= 0) {
    f(std::integral_constant<int, Split>{});
  } else {
    if (split == Split) {
      f(std::integral_constant<int, Split>{});
    } else {
      split_dispatch<BlockN, Split - kStep>(split, f);
    }
  }
}

// The TMA-store epilogue of one math warp whose 16 rows are all inside the
// group: its strip goes out as 2-D bulk tensor stores over the (rows, N)
// output (store_bf16_strip, math_warpgroup.cuh).
template <int BlockN>
__device__ __forceinline__ void store_strip_tma(const CUtensorMap* map_d, const float* res, uint8_t* strip, int lane,
                                                int col0, int row0, int n_cols) {
  store_bf16_strip<BlockN>(res, strip, lane, col0, n_cols, [&](uint8_t* box, int col) {
    cute::SM90_TMA_STORE_2D::copy(map_d, box, col, row0);
  });
}

// The two math warpgroups: wgmma + promotion per K-block, bf16 epilogue.
template <int BlockN, int Cluster, class Sched>
__device__ __forceinline__ void math_loop(const BlockScaledParams& p, const CUtensorMap* map_d, Sched& sched,
                                          uint8_t* smem, uint64_t* full, uint64_t* empty, int rank, int first_tile,
                                          int tile_step, int total, int nkb) {
#if LPMOE_SM90A_DEVICE
  using L = BlockScaledLayout<BlockN>;
  constexpr int kStages = L::kStages;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int wg = warp_uniform(threadIdx.x / 128);
  cutlass::arch::warpgroup_reg_alloc<kFpropRegs.math>();
  // wgmma fragment of a 64 x BlockN tile: thread (warp w, lane l) holds rows
  // 16w + l/4 and +8, columns 8j + 2(l%4) + {0,1}: acc[4j + {0,1}] row r,
  // acc[4j + {2,3}] row r+8.
  const int w_in_wg = warp % 4;
  const int row_in_tile = wg * 64 + w_in_wg * 16 + lane / 4;
  const int b_blocks = (p.n_cols + 127) / 128;
  float acc[BlockN / 2];
  float res[BlockN / 2];
  // This warpgroup's copy of the tile's B scales: [0, nkb) weight-scale
  // block n0 / 128, [nkb, 2 nkb) the next one (a private copy: only a
  // warpgroup barrier).
  float* sb = reinterpret_cast<float*>(smem + L::kBScaleOffset) + wg * 2 * kMaxKBlocks;
  const int tid_wg = threadIdx.x % 128;
  uint8_t* strip = smem + L::kEpilogueOffset + warp * L::kStripBytes;  // this warp's output strip
  // A tile's B scales go global -> registers -> `sb`.  With a cluster of 2
  // the registers are loaded while the previous tile's epilogue runs (one L2
  // round trip per tile off the math warps' path); with cluster 1 at the
  // tile start.  ncu at base clocks, anchor fprop, early against at-start:
  // n192c2 1.70-1.72 vs 1.75 ms, but n192c1 1.77-1.80 vs 1.74-1.75 and n128c1
  // 1.89-1.96 vs 1.78-1.80 (cause not found).
  constexpr bool kEarlyScales = Cluster == 2;
  constexpr int kScalesPerThread = (2 * kMaxKBlocks + 127) / 128;
  float next_sb[kScalesPerThread];
  auto fetch_b_scales = [&](int tile) {
    const TileCoord t = sched.locate(tile);
    const float* bs = p.b_scale + int64_t(t.group) * p.b_scale_member;
    const int lo = t.n_block * BlockN / 128;
    const int hi = min(lo + 1, b_blocks - 1);
#pragma unroll
    for (int q = 0; q < kScalesPerThread; ++q) {
      const int i = tid_wg + 128 * q;
      if (i < 2 * nkb) {
        const int kb = i < nkb ? i : i - nkb;
        next_sb[q] = __ldg(bs + int64_t(kb) * p.b_scale_ld + (i < nkb ? lo : hi));
      }
    }
  };
  if (kEarlyScales && first_tile < total) fetch_b_scales(first_tile);
  uint32_t phase = 0;  // of the full barriers, flipped once per ring turn
  for (int tile = first_tile; tile < total; tile += tile_step) {
    const TileCoord c = sched.locate(tile);
    const int n0 = c.n_block * BlockN;
    const int m0 = (c.m_block * Cluster + rank) * kBlockM;
    const int split = 128 - (n0 % 128);  // first tile column of weight-scale block n0 / 128 + 1
    cutlass::arch::NamedBarrier::sync(128, 1 + wg);  // the previous tile's readers are done
    if constexpr (!kEarlyScales) fetch_b_scales(tile);
#pragma unroll
    for (int q = 0; q < kScalesPerThread; ++q) {
      if (tid_wg + 128 * q < 2 * nkb) sb[tid_wg + 128 * q] = next_sb[q];
    }
    cutlass::arch::NamedBarrier::sync(128, 1 + wg);
#pragma unroll
    for (int i = 0; i < BlockN / 2; ++i) res[i] = 0.0f;

    // Whole ring turns from stage 0 (see the top of the file).  No __trap
    // or other exit may sit on this path: with one, ptxas kept the unrolled
    // loop to the launch bound's 168 registers instead of setmaxnreg's
    // and spilled (found with -Xptxas -v on an experimental guard).
    split_dispatch<BlockN>(split, [&](auto split_tag) {
      constexpr int kSplit = decltype(split_tag)::value;
      // One K-block on stage s (a compile-time index once unrolled).  The
      // body has no branch and no warp barrier, so the compiler can move
      // the next stage's barrier wait up into this one's promotion.
      auto kblock = [&](int s, int kb) {
        Barrier::wait(&full[s], phase);
        // This tile's B scales (after the wait: read before it, they were
        // one more live pair across the promotion and n192c1 spilled).
        const float sb0 = sb[kb], sb1 = sb[nkb + kb];
        // A scales, read before the wgmma fence (which would otherwise wait
        // on the loads).  Rows past the group read stale values and are
        // dropped by the epilogue.
        const float* sa = reinterpret_cast<const float*>(smem + L::kAScaleOffset) + s * kBlockM;
        const float s00 = sa[row_in_tile] * sb0, s01 = sa[row_in_tile] * sb1;
        const float s10 = sa[row_in_tile + 8] * sb0, s11 = sa[row_in_tile + 8] * sb1;
        const uint8_t* st = smem + s * L::kStageBytes;
        kblock_wgmma<BlockN>(sw128_kmajor_desc(st + wg * 64 * kRowBytes), sw128_kmajor_desc(st + L::kABytes), acc);
        release_stage_lanes<Cluster>(&empty[s], lane);  // the wgmmas have read the stage
        promote<BlockN, kSplit>(res, acc, s00, s01, s10, s11);
      };
      ring_turns<kStages>(nkb, phase, kblock, [&](int s) {  // a padding stage: no data
        Barrier::wait(&full[s], phase);
        release_stage_lanes<Cluster>(&empty[s], lane);
      });
    });
    if constexpr (kEarlyScales) {
      if (tile + tile_step < total) fetch_b_scales(tile + tile_step);  // lands during the epilogue
    }

    // Epilogue.  The strip is rewritten only once the stores issued from it
    // a tile ago have read it (they have long finished: no wait in practice).
    const int warp_row0 = m0 + wg * 64 + w_in_wg * 16;  // first tile row of this warp
    if (lane == 0) cute::tma_store_wait<0>();
    __syncwarp();
    if (warp_row0 + 16 <= c.rows) {
      // All 16 rows in the group: bulk tensor stores leave the math warps'
      // path (the masked path below measured 3-4k cycles per tile, ~7 % of
      // a K = 7168 tile, with the tensor pipe idle).
      store_strip_tma<BlockN>(map_d, res, strip, lane, n0, c.row0 + warp_row0, p.n_cols);
    } else if (warp_row0 < c.rows) {
      // The warp straddles the group's end (rows past it belong to the next
      // group): bf16_epilogue's staged 16-byte stores, masked per row and
      // column (N and the tile start are multiples of 16, so a piece is all
      // in or all out).  A warp wholly past the group stores nothing.
      const int out_row = warp_row0 + lane / 2;
      const bool row_ok = out_row < c.rows;
      __nv_bfloat16* drow = static_cast<__nv_bfloat16*>(p.d) + (int64_t(c.row0) + out_row) * p.n_cols;
      bf16_epilogue<BlockN>(
          res, strip, lane, [](int, float*) {},
          [&](int cc, const uint4& piece) {
            const int col = n0 + cc * kEpilogueCols + 8 * (lane % 2);
            if (row_ok && col < p.n_cols) *reinterpret_cast<uint4*>(drow + col) = piece;
          });
    }
  }
  if (lane == 0) cute::tma_store_wait<0>();  // the strips are read before the CTA's memory goes
#endif
}

template <int BlockN, int Cluster>
__global__ void __launch_bounds__(384, 1)
    fp8_block_scaled_grouped_kernel(const __grid_constant__ CUtensorMap tma_a,
                                    const __grid_constant__ CUtensorMap tma_b,
                                    const __grid_constant__ CUtensorMap tma_d, const BlockScaledParams p) {
#if LPMOE_SM90A_DEVICE
  using L = BlockScaledLayout<BlockN>;
  constexpr int kStages = L::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (cute::cast_smem_ptr_to_uint(smem_raw) & 1023)) & 1023);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarOffset);
  uint64_t* empty = full + kStages;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int wg = warp_uniform(threadIdx.x / 128);

  static_assert(Cluster == 1 || Cluster == 2, "cluster of 1 or 2 CTAs along M");
  const int rank = Cluster == 1 ? 0 : static_cast<int>(cute::block_rank_in_cluster());
  // The scheduler hands out cluster tiles of Cluster x 128 rows.
  GroupedTileScheduler<kBlockM * Cluster, kBandRowTiles / Cluster> sched{p.row, p.pad4, p.num_groups,
                                                            (p.n_cols + BlockN - 1) / BlockN,
                                                            reinterpret_cast<int*>(smem + L::kTableOffset)};
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&full[s], 1);      // the producer's arrive + TMA bytes
      Barrier::init(&empty[s], 8 * Cluster);  // one arrive per math warp of each CTA
    }
    cutlass::arch::fence_barrier_init();
  }
  sched.build(warp, lane);  // ends with __syncthreads: barriers are initialised too
  if constexpr (Cluster > 1) cute::cluster_sync();  // partner's barriers exist before any multicast
  const int nkb = (p.k_red + kBlockK - 1) / kBlockK;
  const int total = sched.total_tiles();
  const int first_tile = blockIdx.x / Cluster;
  const int tile_step = gridDim.x / Cluster;

  if (wg == 2) {
    cutlass::arch::warpgroup_reg_dealloc<kFpropRegs.producer>();
    if (threadIdx.x == 256) {
      cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&tma_a));
      cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&tma_b));
      cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&tma_d));
      constexpr int kBRows = BlockN / Cluster;  // B rows this CTA loads (and multicasts)
      RingPos<kStages> pos;
      for (int tile = first_tile; tile < total; tile += tile_step) {
        const TileCoord c = sched.locate(tile);
        const int m0 = (c.m_block * Cluster + rank) * kBlockM;
        const int a_row = c.row0 + m0;
        const int b_row = c.n_block * BlockN + rank * kBRows;
        // This CTA's rows of the group's 1x128 scales, (nkb, round_up(M_t, 4))
        // M-major: one contiguous run per K-block, whole 16-byte units inside
        // the group's padded block (none when the tile is past the group).
        const int tile_rows = max(0, min(kBlockM, c.rows - m0));
        const uint32_t sa_bytes = static_cast<uint32_t>((tile_rows + 3) / 4 * 16);
        const int64_t a_ld = (c.rows + 3) / 4 * 4;
        const float* as = p.a_scale + int64_t(nkb) * c.pad4_0 + m0;
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
          TxBarrier::arrive_and_expect_tx(&full[pos.stage], L::kStageBytes + sa_bytes);
          tma_load_2d(&tma_a, &full[pos.stage], st, kb * kBlockK, a_row);
          if (sa_bytes != 0) {
            bulk_load(&full[pos.stage], smem + L::kAScaleOffset + pos.stage * kBlockM * 4, as + kb * a_ld, sa_bytes);
          }
          uint8_t* sb = st + L::kABytes + rank * kBRows * kRowBytes;
          if constexpr (Cluster == 1) {
            tma_load_3d(&tma_b, &full[pos.stage], sb, kb * kBlockK, b_row, c.group);
          } else {
            tma_load_3d_multicast(&tma_b, &full[pos.stage], (1u << Cluster) - 1u, sb, kb * kBlockK, b_row, c.group);
          }
          pos.next();
        }
      }
    }
  } else {
    math_loop<BlockN, Cluster>(p, &tma_d, sched, smem, full, empty, rank, first_tile, tile_step, total, nkb);
  }
  // No CTA leaves while its partner may still multicast into it or arrive on
  // its barriers.
  if constexpr (Cluster > 1) cute::cluster_sync();
#else
  __trap();  // built without sm_90a code: fail loudly rather than return nothing
#endif
}

}  // namespace fp8_gemm
}  // namespace lpmoe
