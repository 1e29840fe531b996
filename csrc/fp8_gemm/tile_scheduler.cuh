// Persistent tile scheduler for token-grouped GEMMs whose group sizes live
// only on the device.
//
// Every CTA walks the same linear tile order (tile = blockIdx.x, then
// + gridDim.x): group by group, and inside a group in bands of BandRows row
// tiles, row tiles fastest and column tiles outer within a band.  A band's
// token rows (16 x 128 rows: ~15 MB of FP8 activations at K = 7168) stay in
// L2 while the weight columns stream past them once per band, so a group's
// activations come from DRAM once and its weights m_tiles / BandRows times.
// (Bands of 8 column tiles with rows outer, the first order, streamed the
// activations instead: re-read from DRAM once per band, ~1.7x the DRAM bytes
// by count at the anchor shape (ncu: 45 % DRAM throughput against DeepGEMM's
// 33 %), with longer TMA latencies that both CTAs of a cluster wait on.)  No
// band crosses a group boundary (a tile never mixes two experts' weights).
//
// The per-group tile prefix sums, first rows and scale bases are built once
// per CTA in shared memory from the row prefix sums (grouped/group_rows.h):
// the host never needs the split sizes (capturable, the routing may change
// on every replay), and locating a tile costs no global-memory latency.
#pragma once

#include <cstdint>

namespace lpmoe {
namespace fp8_gemm {

struct TileCoord {
  int group;
  int m_block;  // row tile inside the group
  int n_block;  // output-column tile
  int row0;     // first token row of the group in the flat operand
  int rows;     // tokens of the group (M_t)
  int pad4_0;   // pad4 prefix of the group (its 1x128 scale base)
};

// Shared-memory table: tile_start[G+1], row0[G+1], pad4[G] (ints; the host
// checks the operand's rows fit).
constexpr int scheduler_table_bytes(int groups) { return 4 * (3 * groups + 2); }

template <int BlockM, int BandRows>
struct GroupedTileScheduler {
  const int64_t* row;   // G+1 token prefix sums
  const int64_t* pad4;  // G+1 prefix sums of round_up(M_t, 4)
  int num_groups;
  int n_tiles;          // output-column tiles per row tile
  int* tile_start;      // shared memory table (scheduler_table_bytes)
  int group = 0;        // cursor: tile indices only grow per CTA

  __device__ int* row0_table() const { return tile_start + num_groups + 1; }
  __device__ int* pad4_table() const { return tile_start + 2 * num_groups + 2; }

  // All threads of the block call this (one warp scans, then a barrier).
  __device__ void build(int warp, int lane) {
    if (warp == 0) {
      int carry = 0;
      for (int base = 0; base < num_groups; base += 32) {
        const int g = base + lane;
        int tiles = 0;
        if (g < num_groups) {
          const int64_t r0 = row[g];
          tiles = static_cast<int>((row[g + 1] - r0 + BlockM - 1) / BlockM) * n_tiles;
          row0_table()[g] = static_cast<int>(r0);
          pad4_table()[g] = static_cast<int>(pad4[g]);
        }
        int incl = tiles;
#pragma unroll
        for (int d = 1; d < 32; d *= 2) {
          const int v = __shfl_up_sync(0xffffffffu, incl, d);
          if (lane >= d) incl += v;
        }
        if (g < num_groups) tile_start[g] = carry + incl - tiles;
        carry += __shfl_sync(0xffffffffu, incl, 31);
      }
      if (lane == 0) {
        tile_start[num_groups] = carry;
        row0_table()[num_groups] = static_cast<int>(row[num_groups]);
      }
    }
    __syncthreads();
  }

  __device__ int total_tiles() const { return tile_start[num_groups]; }

  __device__ TileCoord locate(int tile) {
    while (tile >= tile_start[group + 1]) ++group;
    TileCoord c;
    c.group = group;
    c.row0 = row0_table()[group];
    c.rows = row0_table()[group + 1] - c.row0;
    c.pad4_0 = pad4_table()[group];
    const int m_tiles = (c.rows + BlockM - 1) / BlockM;
    const int local = tile - tile_start[group];
    const int band = local / (BandRows * n_tiles);  // every band but the group's last is full
    const int in_band = local - band * BandRows * n_tiles;
    const int height = min(BandRows, m_tiles - band * BandRows);
    c.m_block = band * BandRows + in_band % height;
    c.n_block = in_band / height;
    return c;
  }
};

// Weight-gradient tiles: every member owns the same (N / BlockM) x (K /
// BlockN) output tiles, so a tile's member is a division (no table); the
// work per tile (the member's token blocks) varies; an empty member's tiles
// only write zeros (nothing when accumulating).  Inside a member: bands of BandRows row tiles, row tiles
// fastest, as above (a band's dy^T rows stay in L2 while x^T streams).
struct WgradTile {
  int group;
  int m_block;
  int n_block;
};

template <int BandRows>
struct WgradTileOrder {
  int m_tiles;  // row tiles (in scheduler units: Cluster x 128 rows) per member
  int n_tiles;  // column tiles per member

  __device__ int per_member() const { return m_tiles * n_tiles; }

  __device__ WgradTile locate(int tile) const {
    WgradTile t;
    t.group = tile / per_member();
    const int local = tile - t.group * per_member();
    const int band = local / (BandRows * n_tiles);
    const int in_band = local - band * BandRows * n_tiles;
    const int height = min(BandRows, m_tiles - band * BandRows);
    t.m_block = band * BandRows + in_band % height;
    t.n_block = in_band / height;
    return t;
  }
};

}  // namespace fp8_gemm
}  // namespace lpmoe
