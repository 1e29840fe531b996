// Ablation harness for the FP8 block columnwise dequantize (issue 13; not part
// of lpmoe): times lpmoe's kernel (csrc/fp8_block/dequantize.cu, compiled in;
// the staged tile on this padded layout) beside other kernels, on a grouped
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

// Candidate "bulk": persistent CTAs, a producer warp streaming each tile's
// 128 K rows (128 token bytes each, padded layout) into a ring of shared
// stages with cp.async.bulk (one mbarrier per stage, completion by bytes),
// and 8 consumer warps laid out as lpmoe's (thread (c, g): K rows 8c..8c+7,
// tokens 8g..8g+7).  A consumer releases its stage right after its 8 shared
// loads, before the conversions and stores, so the producer refills it while
// the stores drain.  Rows sit at row_offset(k): groups of 8 rows shifted by
// 32 bytes, so the 16 lanes of a half-warp (4 row groups x 4 token pieces)
// hit 16 distinct bank pairs.
namespace bulk {
constexpr int kConsumerWarps = 8;
constexpr int kThreads = 32 * (kConsumerWarps + 1);
__host__ __device__ constexpr int row_offset(int k) { return k * 128 + 32 * ((k >> 3) & 3) + 128 * (k >> 5); }
constexpr int kStageBytes = 132 * 128;
static_assert(row_offset(127) + 128 <= kStageBytes, "stage too small");
using FullBar = cutlass::arch::ClusterTransactionBarrier;
using EmptyBar = cutlass::arch::ClusterBarrier;

// kMode: 0 the kernel; diagnostics (wrong output): 1 reads only, 2 writes
// only, 3 writes only in K-tile-fastest order (whole output rows together).
template <int kMode = 0>
__device__ __forceinline__ bool tile_at(const fp8_block::DequantizeArgs& a, int64_t i, TileInfo& ti, int& tile_x) {
  const int bx = static_cast<int>(ceil_div<int64_t>(a.cols, kTile));
  const int64_t j = kMode == 3 ? i / bx : i % a.max_row_tiles;
  tile_x = static_cast<int>(kMode == 3 ? i % bx : i / a.max_row_tiles);
  return locate_tile(a.group, a.rows, j, ti) && ti.rows_valid > 0;
}

template <typename OType, bool kE5M2, int kStages, int kMode = 0>
__global__ void __launch_bounds__(kThreads) dq_cols_bulk(const fp8_block::DequantizeArgs args, int64_t tiles) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      FullBar::init(&full[s], 1);
      EmptyBar::init(&empty[s], kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const int64_t K = args.cols;
  const uint8_t* q = static_cast<const uint8_t*>(args.data);
  int stage = 0;
  uint32_t phase = 0;
  if (warp == kConsumerWarps) {  // producer
    if (kMode >= 2) return;
    for (int64_t i = blockIdx.x; i < tiles; i += gridDim.x) {
      TileInfo ti; int tile_x;
      if (!tile_at<kMode>(args, i, ti, tile_x)) continue;
      const int64_t col0 = static_cast<int64_t>(tile_x) * kTile;
      const int cols_valid = static_cast<int>(K - col0 < kTile ? K - col0 : kTile);
      EmptyBar::wait(&empty[stage], phase ^ 1u);
      if (lane == 0) FullBar::arrive_and_expect_tx(&full[stage], static_cast<uint32_t>(cols_valid) * 128u);
      __syncwarp();
      const int64_t pitch = round_up<int64_t>(ti.m, kTile);
      const uint8_t* src = q + K * ti.pad128_start + ti.local_tile * kTile + col0 * pitch;
      uint8_t* dst = smem + stage * kStageBytes;
      for (int k = lane; k < cols_valid; k += 32)
        cute::SM90_BULK_COPY_G2S::copy(src + k * pitch, &full[stage], dst + row_offset(k), 128);
      if (++stage == kStages) { stage = 0; phase ^= 1u; }
    }
    return;
  }
  const int g = 4 * (warp & 3) + (lane & 3);
  const int c = 8 * (warp >> 2) + (lane >> 2);
  const int tok0 = 8 * g;
  OType* out = static_cast<OType*>(args.out);
  const int64_t ld = round_up<int64_t>(K, 4);
  for (int64_t i = blockIdx.x; i < tiles; i += gridDim.x) {
    TileInfo ti; int tile_x;
    if (!tile_at<kMode>(args, i, ti, tile_x)) continue;
    const int64_t col0 = static_cast<int64_t>(tile_x) * kTile;
    const int cols_valid = static_cast<int>(K - col0 < kTile ? K - col0 : kTile);
    const bool mine = c * 8 < cols_valid && tok0 < ti.rows_valid;
    float s[8];
    if (mine) {
      const float4* sp = reinterpret_cast<const float4*>(args.scale + ld * (ti.pad128_start / kTile) +
                                                         ti.local_tile * ld + col0 + c * 8);
      const float4 lo = __ldg(sp), hi = __ldg(sp + 1);
      s[0] = lo.x; s[1] = lo.y; s[2] = lo.z; s[3] = lo.w; s[4] = hi.x; s[5] = hi.y; s[6] = hi.z; s[7] = hi.w;
    }
    uint2 chunk[8];
    if (kMode >= 2) {
#pragma unroll
      for (int e = 0; e < 8; ++e) chunk[e] = make_uint2(e, tok0);
    } else {
    FullBar::wait(&full[stage], phase);
    if (mine) {
      const uint8_t* st = smem + stage * kStageBytes + 8 * g;
#pragma unroll
      for (int e = 0; e < 8; ++e) chunk[e] = *reinterpret_cast<const uint2*>(st + row_offset(8 * c + e));
    }
    __syncwarp();
    if (lane == 0) EmptyBar::arrive(&empty[stage]);
    if (++stage == kStages) { stage = 0; phase ^= 1u; }
    }
    if (!mine) continue;
    if (kMode == 1) {  // keep the loads alive without storing
      if (chunk[0].x == 0x12345678u && chunk[7].y == 0x9abcdef0u) out[0] = OType(1.0f);
      continue;
    }
    OType* dst = out + (ti.row0 + tok0) * K + col0 + c * 8;
#pragma unroll
    for (int r = 0; r < 8; ++r, dst += K) {
      if (tok0 + r >= ti.rows_valid) continue;
      const int word = r >> 2, shift = 8 * (r & 3);
      uint32_t w[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t b0 = (word ? chunk[4 * h].y : chunk[4 * h].x) >> shift;
        const uint32_t b1 = (word ? chunk[4 * h + 1].y : chunk[4 * h + 1].x) >> shift;
        const uint32_t b2 = (word ? chunk[4 * h + 2].y : chunk[4 * h + 2].x) >> shift;
        const uint32_t b3 = (word ? chunk[4 * h + 3].y : chunk[4 * h + 3].x) >> shift;
        w[h] = __byte_perm(__byte_perm(b0, b1, 0x0040), __byte_perm(b2, b3, 0x0040), 0x5410);
      }
      dequant8_store<OType, kE5M2>(dst, make_uint2(w[0], w[1]), s);
    }
  }
}

template <int kStages, int kMode = 0>
void launch(const fp8_block::DequantizeArgs& b, unsigned tiles) {
  auto* k = dq_cols_bulk<__nv_bfloat16, false, kStages, kMode>;
  const int smem = kStages * kStageBytes;
  static int ctas = 0;
  if (ctas == 0) {
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    int per_sm = 0, sms = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, kThreads, smem);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    ctas = per_sm * sms;
    printf("[bulk%d: %d CTAs/SM]\n", kStages, per_sm);
  }
  const unsigned grid = tiles < unsigned(ctas) ? tiles : unsigned(ctas);
  k<<<grid, kThreads, smem>>>(b, tiles);
}
}  // namespace bulk

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
      {"registers", [](fp8_block::DequantizeArgs b, unsigned n) { dq_cols_registers<__nv_bfloat16, false><<<n, 256>>>(b); }},
      {"bulk3", [](fp8_block::DequantizeArgs b, unsigned n) { bulk::launch<3>(b, n); }},
      {"rd-contig", [](fp8_block::DequantizeArgs b, unsigned n) { rd::contig<<<132 * 8, 256>>>(b, int64_t(b.max_row_tiles) * 128 * b.cols); }},
      {"rd-pattern", [](fp8_block::DequantizeArgs b, unsigned n) { rd::pattern<<<n, 256>>>(b); }},
      {"rd-rows512", [](fp8_block::DequantizeArgs b, unsigned n) { rd::rows512<<<n / 4, 256>>>(b); }},
      {"writes-only", [](fp8_block::DequantizeArgs b, unsigned n) { bulk::launch<3, 2>(b, n); }},
      {"writes-only-kfast", [](fp8_block::DequantizeArgs b, unsigned n) { bulk::launch<3, 3>(b, n); }},
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
