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

// Candidate "staged-<hint>": lpmoe's staged tile with the output stores
// carrying a cache hint (kHint 1: st.global.cs, streaming; 2: L2 evict_first
// policy; 3: L2 evict_last policy).
namespace hint {
template <int kHint>
__device__ __forceinline__ void st16(void* p, uint4 v, uint64_t pol) {
  if constexpr (kHint == 1) {
    __stcs(reinterpret_cast<uint4*>(p), v);
  } else {
    asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w), "l"(pol) : "memory");
  }
}
template <int kHint>
__global__ void __launch_bounds__(256, 3) kern(const fp8_block::DequantizeArgs args, int64_t chunks) {
  using namespace fp8_block::dequant_detail;
  __shared__ __align__(16) uint8_t smem[kStagedSmemBytes];
  uint64_t pol = 0;
  if constexpr (kHint == 2) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  if constexpr (kHint == 3) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  const int64_t chunk = blockIdx.x % chunks;
  const int tile_x = static_cast<int>(blockIdx.x / chunks);
  const int64_t K = args.cols;
  const int64_t col0 = static_cast<int64_t>(tile_x) * kTile;
  const int cols_valid = static_cast<int>(K - col0 < kTile ? K - col0 : kTile);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t j0 = kStagedTiles * chunk;
  {
    const int t = (lane >> 3) & 1, piece = lane & 7, sub_row = lane >> 4;
    TileInfo ti;
    if (staged_tile(args, j0 + t, ti)) {
      const int64_t pitch = round_up<int64_t>(ti.m, kTile);
      const uint8_t* src = static_cast<const uint8_t*>(args.data) + K * ti.pad128_start + ti.local_tile * kTile +
                           col0 * pitch + 16 * piece;
      uint4 v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int k = 16 * warp + 2 * i + sub_row;
        if (k < cols_valid) v[i] = __ldg(reinterpret_cast<const uint4*>(src + k * pitch));
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int k = 16 * warp + 2 * i + sub_row;
        if (k < cols_valid) *reinterpret_cast<uint4*>(smem + staged_row_offset(k) + kTile * t + 16 * piece) = v[i];
      }
    }
  }
  __syncthreads();
  const int g = 4 * (warp & 3) + (lane & 3), c = 8 * (warp >> 2) + (lane >> 2), tok0 = 8 * g;
  if (c * 8 >= cols_valid) return;
  for (int t = 0; t < kStagedTiles; ++t) {
    TileInfo ti;
    if (!staged_tile(args, j0 + t, ti) || tok0 >= ti.rows_valid) continue;
    uint2 q[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) q[e] = *reinterpret_cast<const uint2*>(smem + staged_row_offset(8 * c + e) + kTile * t + 8 * g);
    float sc[8];
    column_scales8<1>(args, ti, 0, tile_x, col0 + 8 * c, sc);
    __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(args.out) + (ti.row0 + tok0) * K + col0 + 8 * c;
#pragma unroll
    for (int r = 0; r < 8; ++r, dst += K) {
      if (tok0 + r >= ti.rows_valid) continue;
      const int word = r >> 2, shift = 8 * (r & 3);
      uint32_t w[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t b0 = (word ? q[4 * h].y : q[4 * h].x) >> shift, b1 = (word ? q[4 * h + 1].y : q[4 * h + 1].x) >> shift;
        const uint32_t b2 = (word ? q[4 * h + 2].y : q[4 * h + 2].x) >> shift, b3 = (word ? q[4 * h + 3].y : q[4 * h + 3].x) >> shift;
        w[h] = __byte_perm(__byte_perm(b0, b1, 0x0040), __byte_perm(b2, b3, 0x0040), 0x5410);
      }
      uint4 o;
      uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = fp8x2_to_float2<false>(w[i >> 1] >> (16 * (i & 1)));
        ow[i] = pack2<__nv_bfloat16>(__fmul_rn(f.x, sc[2 * i]), __fmul_rn(f.y, sc[2 * i + 1]));
      }
      st16<kHint>(dst, o, pol);
    }
  }
}
template <int kHint>
void launch(const fp8_block::DequantizeArgs& b, unsigned) {
  const int64_t chunks = (b.max_row_tiles + 1) / 2;
  kern<kHint><<<unsigned(chunks * ((b.cols + 127) / 128)), 256>>>(b, chunks);
}
}  // namespace hint
