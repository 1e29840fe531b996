// Included by harness.cu only (after its using-declarations).
#pragma once

// Read-side diagnostics (no output; "MISMATCH" expected): the column
// source read (a) as one contiguous stream, (b) in lpmoe's tile pattern
// (thread (c, g): 8 K rows x 8 token bytes), (c) as 512 contiguous token
// bytes per K row and warp (a CTA: 128 K rows x 512 tokens).
namespace rd {
__global__ void __launch_bounds__(256) contig(const fp8_block::DequantizeArgs a, int64_t bytes) {
  const uint4* p = static_cast<const uint4*>(a.data);
  uint32_t x = 0;
  for (int64_t i = blockIdx.x * 256 + threadIdx.x; i < bytes / 16; i += int64_t(gridDim.x) * 256) {
    const uint4 v = __ldg(p + i); x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x12345678u) static_cast<uint8_t*>(a.out)[0] = 1;
}
__global__ void __launch_bounds__(256) pattern(const fp8_block::DequantizeArgs args) {
  const int64_t j = blockIdx.x % args.max_row_tiles;
  const int tile_x = static_cast<int>(blockIdx.x / args.max_row_tiles);
  TileInfo ti;
  if (!locate_tile(args.group, args.rows, j, ti)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = 4 * (warp & 3) + (lane & 3), c = 8 * (warp >> 2) + (lane >> 2);
  const int64_t K = args.cols, pitch = round_up<int64_t>(ti.m, kTile);
  const uint8_t* src = static_cast<const uint8_t*>(args.data) + K * ti.pad128_start + ti.local_tile * kTile +
                       (int64_t(tile_x) * kTile + c * 8) * pitch + 8 * g;
  uint32_t x = 0;
#pragma unroll
  for (int e = 0; e < 8; ++e) { const uint2 v = __ldg(reinterpret_cast<const uint2*>(src + e * pitch)); x ^= v.x ^ v.y; }
  if (x == 0x12345678u) static_cast<uint8_t*>(args.out)[0] = 1;
}
// One CTA per (512-token chunk of a member, K tile); members must be multiples of 512 tokens.
__global__ void __launch_bounds__(256) rows512(const fp8_block::DequantizeArgs args) {
  const int64_t chunks = args.max_row_tiles / 4;
  const int64_t j = 4 * (blockIdx.x % chunks);
  const int tile_x = static_cast<int>(blockIdx.x / chunks);
  TileInfo ti;
  if (!locate_tile(args.group, args.rows, j, ti)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t K = args.cols, pitch = round_up<int64_t>(ti.m, kTile);
  const uint8_t* src = static_cast<const uint8_t*>(args.data) + K * ti.pad128_start + ti.local_tile * kTile +
                       (int64_t(tile_x) * kTile + warp * 16) * pitch + 16 * lane;
  uint32_t x = 0;
#pragma unroll
  for (int e = 0; e < 16; ++e) { const uint4 v = __ldg(reinterpret_cast<const uint4*>(src + e * pitch)); x ^= v.x ^ v.y ^ v.z ^ v.w; }
  if (x == 0x12345678u) static_cast<uint8_t*>(args.out)[0] = 1;
}
}  // namespace rd
