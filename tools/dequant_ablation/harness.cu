// Ablation harness for the FP8 block columnwise dequantize (issue 13; not part
// of lpmoe): times lpmoe's kernel (csrc/fp8_block/dequantize.cu, compiled in)
// beside candidate kernels written here, on a grouped columnwise buffer
// (G equal members of M tokens, K columns, padded columnwise layout), each as
// a ratio to a device copy of the same bytes (1 read + 2 written per
// element).  Every candidate's output is compared bitwise with lpmoe's first.
//   nvcc -O3 -std=c++20 -arch=sm_90a -I../../csrc harness.cu ../../csrc/fp8_block/dequantize.cu -o dq
//   ./dq G M K
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/dequant_vec.cuh"
#include "fp8_block/dequant_columns.cuh"
#include "fp8_block/fp8_block.h"
#include "grouped/row_tiles.cuh"

using namespace lpmoe;
using grouped::kTile;
using grouped::TileInfo;
using grouped::locate_tile;

// lpmoe's columnwise tile (csrc/fp8_block/dequant_columns.cuh, 1D scaling)
// for token tile j and K tile tile_x; the kernels below take the tiles in
// other orders.
template <typename OType, bool kE5M2>
__device__ __forceinline__ void dq_cols_tile(const fp8_block::DequantizeArgs& args, int64_t j, int tile_x) {
  fp8_block::dequant_detail::dequantize_columns_tile<OType, kE5M2, 1>(args, j, tile_x);
}

// lpmoe's tile order (token tiles fastest), K-tile fastest (kKFast: CTAs
// running together write whole output rows), or runs of kW K-tiles of one
// token tile, token tiles next (kW | the K-tile count).
template <typename OType, bool kE5M2, bool kKFast, int kW = 1>
__global__ void __launch_bounds__(256) dq_cols_base(const fp8_block::DequantizeArgs args) {
  const int bx_count = static_cast<int>(ceil_div<int64_t>(args.cols, kTile));
  int64_t j = kKFast ? blockIdx.x / bx_count : blockIdx.x % args.max_row_tiles;
  int tile_x = static_cast<int>(kKFast ? blockIdx.x % bx_count : blockIdx.x / args.max_row_tiles);
  if constexpr (kW > 1) {
    const int64_t span = args.max_row_tiles * kW;
    const int64_t rem = blockIdx.x % span;
    j = rem / kW;
    tile_x = static_cast<int>(blockIdx.x / span) * kW + static_cast<int>(rem % kW);
  }
  dq_cols_tile<OType, kE5M2>(args, j, tile_x);
}

// Candidate "kloop": one CTA per token tile and run of kL K-tiles, taken in
// turn (token-tile fastest across CTAs, as lpmoe's; 1 KB of each output row
// per CTA at kL = 4).
template <typename OType, bool kE5M2, int kL>
__global__ void __launch_bounds__(256) dq_cols_kloop(const fp8_block::DequantizeArgs args) {
  const int bx_count = static_cast<int>(ceil_div<int64_t>(args.cols, kTile));
  const int64_t j = blockIdx.x % args.max_row_tiles;
  const int x0 = static_cast<int>(blockIdx.x / args.max_row_tiles) * kL;
  for (int i = 0; i < kL && x0 + i < bx_count; ++i) dq_cols_tile<OType, kE5M2>(args, j, x0 + i);
}
// Candidate "wide16": a 128-thread CTA per 128x128 tile; thread (c, g) loads
// tokens 16g..16g+15 of K rows 8c..8c+7 as 16-byte loads, so the 8 lanes of
// a row cover its 128 tokens (whole lines per load instruction, 4 rows per
// warp) instead of 32-byte pieces of 8 rows; it writes those 16 tokens x 8
// columns as 16 output vectors (a warp's store covers 8 rows x 64 bytes).
template <typename OType, bool kE5M2, bool kKFast>
__global__ void __launch_bounds__(128) dq_cols_wide16(const fp8_block::DequantizeArgs args) {
  const int64_t K = args.cols;
  const int bx_count = static_cast<int>(ceil_div<int64_t>(K, kTile));
  const int64_t j = kKFast ? blockIdx.x / bx_count : blockIdx.x % args.max_row_tiles;
  const int tile_x = static_cast<int>(kKFast ? blockIdx.x % bx_count : blockIdx.x / args.max_row_tiles);
  TileInfo ti;
  if (!locate_tile(args.group, args.rows, j, ti)) return;
  const int64_t col0 = static_cast<int64_t>(tile_x) * kTile;
  const int cols_valid = static_cast<int>(K - col0 < kTile ? K - col0 : kTile);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane & 7;                      // tokens 16g..16g+15
  const int c = 4 * warp + (lane >> 3);        // K rows 8c..8c+7
  const int tok0 = 16 * g;
  if (c * 8 >= cols_valid || tok0 >= ti.rows_valid) return;
  const int64_t pitch = args.pad_columnwise_tokens ? round_up<int64_t>(ti.m, kTile) : ti.m;
  const int64_t tokens_in_buffer = args.pad_columnwise_tokens ? kTile : ti.rows_valid;
  const uint8_t* src = static_cast<const uint8_t*>(args.data) + K * ti.pad128_start + ti.local_tile * kTile +
                       (col0 + c * 8) * pitch + tok0;
  uint4 chunk[8];
  if (pitch % 16 == 0 && tok0 + 16 <= tokens_in_buffer) {
#pragma unroll
    for (int e = 0; e < 8; ++e, src += pitch) chunk[e] = __ldg(reinterpret_cast<const uint4*>(src));
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      uint32_t w[4] = {0, 0, 0, 0};
      for (int k = 0; k < 16; ++k)
        if (tok0 + k < ti.rows_valid) w[k >> 2] |= static_cast<uint32_t>(src[e * pitch + k]) << (8 * (k & 3));
      chunk[e] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  const int64_t ld = round_up<int64_t>(K, 4);
  const float4* sp = reinterpret_cast<const float4*>(args.scale + ld * (ti.pad128_start / kTile) +
                                                     ti.local_tile * ld + col0 + c * 8);
  const float4 lo = __ldg(sp), hi = __ldg(sp + 1);
  const float s[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  OType* dst = static_cast<OType*>(args.out) + (ti.row0 + tok0) * K + col0 + c * 8;
#pragma unroll
  for (int r = 0; r < 16; ++r, dst += K) {
    if (tok0 + r >= ti.rows_valid) continue;
    const int shift = 8 * (r & 3);
    uint32_t w[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t* c0 = reinterpret_cast<const uint32_t*>(&chunk[4 * h]);
      const uint32_t* c1 = reinterpret_cast<const uint32_t*>(&chunk[4 * h + 1]);
      const uint32_t* c2 = reinterpret_cast<const uint32_t*>(&chunk[4 * h + 2]);
      const uint32_t* c3 = reinterpret_cast<const uint32_t*>(&chunk[4 * h + 3]);
      const uint32_t b0 = c0[r >> 2] >> shift, b1 = c1[r >> 2] >> shift;
      const uint32_t b2 = c2[r >> 2] >> shift, b3 = c3[r >> 2] >> shift;
      w[h] = __byte_perm(__byte_perm(b0, b1, 0x0040), __byte_perm(b2, b3, 0x0040), 0x5410);
    }
    dequant8_store<OType, kE5M2>(dst, make_uint2(w[0], w[1]), s);
  }
}

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("ERR %s line %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

__global__ void fill_bytes(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = uint8_t(h & 0x7F) ^ uint8_t((h >> 8) & 0x80) ;  // finite e4m3 mostly (0x7f/0xff are NaN: kept, compared as bits)
  }
}
__global__ void fill_scales(float* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = ldexpf(1.0f, int(i % 17) - 8);
}

template <class F>
float time_ms(F&& f, int reps = 9, int iters = 20) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> v;
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(a); for (int i = 0; i < iters; ++i) f(); cudaEventRecord(b); cudaEventSynchronize(b);
    float t; cudaEventElapsedTime(&t, a, b); v.push_back(t / iters);
  }
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const int G = argc > 3 ? atoi(argv[1]) : 8;
  const int64_t M = argc > 3 ? atoll(argv[2]) : 8192, K = argc > 3 ? atoll(argv[3]) : 7168;
  const int last_short = argc > 4 ? atoi(argv[4]) : 0;  // tokens taken off the last member (partial tiles)
  std::vector<int64_t> rows(G + 1), pad(G + 1);
  for (int t = 0; t <= G; ++t) rows[t] = t * M - (t == G ? last_short : 0);
  for (int t = 0; t <= G; ++t) pad[t] = t == 0 ? 0 : pad[t - 1] + (rows[t] - rows[t - 1] + 127) / 128 * 128;
  const int64_t T = rows[G], P = pad[G];
  int64_t* d_rows; int64_t* d_pad;
  CK(cudaMalloc(&d_rows, 8 * (G + 1))); CK(cudaMalloc(&d_pad, 8 * (G + 1)));
  CK(cudaMemcpy(d_rows, rows.data(), 8 * (G + 1), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_pad, pad.data(), 8 * (G + 1), cudaMemcpyHostToDevice));
  uint8_t* data; float* scale; __nv_bfloat16 *out0, *out1;
  const int64_t ld = (K + 3) / 4 * 4;
  CK(cudaMalloc(&data, P * K)); CK(cudaMalloc(&scale, sizeof(float) * (P / 128) * ld));
  CK(cudaMalloc(&out0, 2 * T * K)); CK(cudaMalloc(&out1, 2 * T * K));
  fill_bytes<<<1024, 256>>>(data, P * K, 7); fill_scales<<<256, 256>>>(scale, (P / 128) * ld);
  fp8_block::DequantizeArgs a;
  a.data = data; a.scale = scale; a.columnwise = true; a.pad_columnwise_tokens = true; a.block_dim = 1;
  a.rows = T; a.cols = K; a.group.row = d_rows; a.group.pad4 = d_pad; a.group.pad64 = d_pad; a.group.pad128 = d_pad;
  a.group.pad512 = d_pad; a.group.num_tensors = G; a.out_dtype = DType::kBFloat16; a.max_row_tiles = P / 128;
  const unsigned ctas = unsigned(a.max_row_tiles * ((K + 127) / 128));
  auto base = [&]() { a.out = out0; CK(fp8_block::launch_dequantize(a, 0)); };
  struct V { const char* name; void (*launch)(fp8_block::DequantizeArgs, unsigned); };
  V vars[] = {
      {"copy-of-base", [](fp8_block::DequantizeArgs b, unsigned n) { dq_cols_base<__nv_bfloat16, false, false><<<n, 256>>>(b); }},
      {"w2", [](fp8_block::DequantizeArgs b, unsigned n) { dq_cols_base<__nv_bfloat16, false, false, 2><<<n, 256>>>(b); }},
      {"kloop2", [](fp8_block::DequantizeArgs b, unsigned n) { dq_cols_kloop<__nv_bfloat16, false, 2><<<(n + 1) / 2, 256>>>(b); }},
      {"kloop4", [](fp8_block::DequantizeArgs b, unsigned n) { dq_cols_kloop<__nv_bfloat16, false, 4><<<(n + 3) / 4, 256>>>(b); }},
      {"wide16", [](fp8_block::DequantizeArgs b, unsigned n) { dq_cols_wide16<__nv_bfloat16, false, false><<<n, 128>>>(b); }},
  };
  base(); CK(cudaDeviceSynchronize());
  std::vector<uint8_t> h0(2 * T * K), h1(2 * T * K);
  CK(cudaMemcpy(h0.data(), out0, h0.size(), cudaMemcpyDeviceToHost));
  std::vector<bool> same;
  for (auto& v : vars) {
    fp8_block::DequantizeArgs b = a; b.out = out1;
    CK(cudaMemset(out1, 0xFF, 2 * T * K)); v.launch(b, ctas); CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(h1.data(), out1, h1.size(), cudaMemcpyDeviceToHost));
    same.push_back(memcmp(h0.data(), h1.data(), h0.size()) == 0);
  }
  uint8_t *cs, *cd; const size_t cb = size_t(T) * K * 3 / 2;  // a copy moving the same bytes
  CK(cudaMalloc(&cs, cb)); CK(cudaMalloc(&cd, cb));
  const double bytes = 3.0 * T * K;
  for (int round = 0; round < 3; ++round) {
    const float tc = time_ms([&] { cudaMemcpyAsync(cd, cs, cb, cudaMemcpyDeviceToDevice, 0); });
    const float t0 = time_ms(base);
    printf("G%d M%lld K%lld short%d | copy %.3f ms %.0f GB/s | lpmoe %.2f", G, (long long)M, (long long)K, last_short,
           tc, bytes / tc / 1e6, tc / t0);
    for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); ++i) {
      fp8_block::DequantizeArgs b = a; b.out = out1;
      const float t = time_ms([&] { vars[i].launch(b, ctas); });
      printf(" | %s %.2f%s", vars[i].name, tc / t, same[i] ? "" : " MISMATCH");
    }
    printf("\n");
  }
  return 0;
}
