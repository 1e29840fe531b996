// Ablation harness for the FP8 block columnwise dequantize (issue 13; not part
// of lpmoe): times lpmoe's kernel (csrc/fp8_block/dequantize.cu, compiled in;
// the staged tile with TMA-store output on this padded layout) beside other kernels, on a grouped
// columnwise buffer (G equal members of M tokens, K columns, padded
// columnwise layout), each as a ratio to a device copy of the same bytes (1
// read + 2 written per element).  Every candidate's output is compared
// bitwise with lpmoe's first; the read-only and write-only diagnostics
// report MISMATCH by design.
//   nvcc -O3 -std=c++20 -arch=sm_90a -I../../csrc -I<cutlass>/include harness.cu \
//        ../../csrc/fp8_block/dequantize.cu -o dq
//   ./dq G M K [short]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "harness_common.cuh"
#include "common/dequant_vec.cuh"
#include "fp8_block/dequant_columns.cuh"
#include "fp8_block/fp8_block.h"
#include "grouped/row_tiles.cuh"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cutlass/arch/barrier.h"

using namespace lpmoe;
using grouped::kTile;
using grouped::TileInfo;
using grouped::locate_tile;

// lpmoe's register columnwise tile (csrc/fp8_block/dequant_columns.cuh, 1D
// scaling, the path of unpadded single tensors) for token tile j and K tile
// tile_x.
template <typename OType, bool kE5M2>
__device__ __forceinline__ void dq_cols_tile(const fp8_block::DequantizeArgs& args, int64_t j, int tile_x) {
  fp8_block::dequant_detail::dequantize_columns_tile<OType, kE5M2, 1>(args, j, tile_x);
}

// The register tile in lpmoe's tile order (token tiles fastest).  (Other
// orders and tile shapes tried in stop 33 are in docs/perf-notes.md.)
template <typename OType, bool kE5M2>
__global__ void __launch_bounds__(256) dq_cols_registers(const fp8_block::DequantizeArgs args) {
  dq_cols_tile<OType, kE5M2>(args, blockIdx.x % args.max_row_tiles, static_cast<int>(blockIdx.x / args.max_row_tiles));
}

// lpmoe's staged tile with 16-byte output stores (the path of fp32 outputs
// and of unaligned 16-bit ones; before stop 57 every staged call's), beside
// lpmoe's choice for bf16, the staged tile with TMA-store output tiles.
__global__ void __launch_bounds__(256, 3) dq_cols_staged_stores(const fp8_block::DequantizeArgs args, int64_t chunks) {
  __shared__ __align__(16) uint8_t smem[fp8_block::dequant_detail::kStagedSmemBytes];
  fp8_block::dequant_detail::dequantize_columns_staged<__nv_bfloat16, false, 1>(
      args, blockIdx.x % chunks, static_cast<int>(blockIdx.x / chunks), smem);
}
inline void launch_staged_stores(const fp8_block::DequantizeArgs& b) {
  const int64_t chunks = (b.max_row_tiles + 1) / 2;
  dq_cols_staged_stores<<<unsigned(chunks * ((b.cols + 127) / 128)), 256>>>(b, chunks);
}

#include "bulk_pipeline.cuh"
#include "probes.cuh"
#include "tma_store.cuh"

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

int main(int argc, char** argv) {
  const int G = argc > 3 ? atoi(argv[1]) : 8;
  const int64_t M = argc > 3 ? atoll(argv[2]) : 8192, K = argc > 3 ? atoll(argv[3]) : 7168;
  const int last_short = argc > 4 ? atoi(argv[4]) : 0;  // tokens taken off the last member (partial tiles)
  // argv[5] "skew": 90 % of the G x M tokens in member 0, the rest spread
  // evenly (bench_fp8_block.py's skewed members), before last_short.
  const bool skew = argc > 5 && strcmp(argv[5], "skew") == 0;
  std::vector<int64_t> rows, pad;
  member_rows(G, M, last_short, skew, rows, pad);
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
      {"staged-stg", [](fp8_block::DequantizeArgs b, unsigned) { launch_staged_stores(b); }},
      {"registers", [](fp8_block::DequantizeArgs b, unsigned n) { dq_cols_registers<__nv_bfloat16, false><<<n, 256>>>(b); }},
      {"bulk3", [](fp8_block::DequantizeArgs b, unsigned n) { bulk::launch<3>(b, n); }},
      {"rd-contig", [](fp8_block::DequantizeArgs b, unsigned n) { rd::contig<<<132 * 8, 256>>>(b, int64_t(b.max_row_tiles) * 128 * b.cols); }},
      {"rd-pattern", [](fp8_block::DequantizeArgs b, unsigned n) { rd::pattern<<<n, 256>>>(b); }},
      {"rd-rows512", [](fp8_block::DequantizeArgs b, unsigned n) { rd::rows512<<<n / 4, 256>>>(b); }},
      {"writes-only", [](fp8_block::DequantizeArgs b, unsigned n) { bulk::launch<3, 2>(b, n); }},
      {"writes-only-kfast", [](fp8_block::DequantizeArgs b, unsigned n) { bulk::launch<3, 3>(b, n); }},
      {"tma-writes128x4", [](fp8_block::DequantizeArgs b, unsigned) { tmaw::launch<128, 4>(b); }},
      {"tma-writes128x1", [](fp8_block::DequantizeArgs b, unsigned) { tmaw::launch<128, 1>(b); }},
      {"tma-writes256x2", [](fp8_block::DequantizeArgs b, unsigned) { tmaw::launch<256, 2>(b); }},
  };
  if (!tmaw::encode(&tmaw::g_map128, out1, T, K, 128) || !tmaw::encode(&tmaw::g_map256, out1, T, K, 256)) {
    printf("tensor map encode failed\n");
    return 1;
  }
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
    printf("G%d M%lld K%lld short%d%s | copy %.3f ms %.0f GB/s | lpmoe %.2f", G, (long long)M, (long long)K, last_short, skew ? " skew" : "",
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
