// A/B harness for the MXFP8 dequantize (issue 13; not part of lpmoe): lpmoe's
// kernel (csrc/mxfp8/dequantize.cu compiled in: whole 16-bit tiles leave
// through TMA stores) beside the same tile with 16-byte output stores (its
// form before stop 58, still the path of fp32 outputs), on G members of M
// rows (rows layout, swizzled scales), rowwise and columnwise sources.  The
// stores form's output is compared bitwise with lpmoe's; each is printed as
// a ratio to a device copy of the same bytes (1 read + 2 written per element,
// the scale bytes left out as the copy's).
//   nvcc -O3 -std=c++20 -arch=sm_90a -I../../csrc -I<cutlass>/include mx_harness.cu \
//        ../../csrc/mxfp8/dequantize.cu -o mxdq
//   ./mxdq G M K [short] [skew]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "harness_common.cuh"
#include "mxfp8/dequant_tile.cuh"
#include "mxfp8/mxfp8.h"

using namespace lpmoe;

template <bool kColumnwise>
__global__ void __launch_bounds__(256) stores_kernel(const mxfp8::DequantizeArgs args) {
  mxfp8::dequant_detail::dequantize_tile_stores<__nv_bfloat16, false, kColumnwise>(args, blockIdx.x);
}

__global__ void fill_bytes(uint8_t* p, size_t n, uint32_t seed, uint32_t lo, uint32_t span) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = uint8_t(span ? lo + h % span : h);
  }
}

int main(int argc, char** argv) {
  const int G = argc > 3 ? atoi(argv[1]) : 8;
  const int64_t M = argc > 3 ? atoll(argv[2]) : 8192, K = argc > 3 ? atoll(argv[3]) : 7168;
  const int last_short = argc > 4 ? atoi(argv[4]) : 0;
  const bool skew = argc > 5 && strcmp(argv[5], "skew") == 0;  // 90 % of the tokens in member 0
  std::vector<int64_t> rows, pad;
  member_rows(G, M, last_short, skew, rows, pad);
  const int64_t T = rows[G], P = pad[G];
  int64_t *d_rows, *d_pad;
  CK(cudaMalloc(&d_rows, 8 * (G + 1))); CK(cudaMalloc(&d_pad, 8 * (G + 1)));
  CK(cudaMemcpy(d_rows, rows.data(), 8 * (G + 1), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_pad, pad.data(), 8 * (G + 1), cudaMemcpyHostToDevice));
  const int64_t sx = ((K + 31) / 32 + 3) / 4 * 4, kp = (K + 127) / 128 * 128;
  const size_t scale_bytes = std::max<size_t>(P * sx, P / 32 * kp);
  uint8_t *data, *scale; __nv_bfloat16 *out0, *out1;
  CK(cudaMalloc(&data, T * K)); CK(cudaMalloc(&scale, scale_bytes));
  CK(cudaMalloc(&out0, 2 * T * K)); CK(cudaMalloc(&out1, 2 * T * K));
  fill_bytes<<<1024, 256>>>(data, T * K, 7, 0, 0);
  fill_bytes<<<256, 256>>>(scale, scale_bytes, 11, 110, 30);
  uint8_t *cs, *cd; const size_t cb = size_t(T) * K * 3 / 2;  // a copy moving the same bytes
  CK(cudaMalloc(&cs, cb)); CK(cudaMalloc(&cd, cb));
  const double bytes = 3.0 * T * K;
  for (int round = 0; round < 3; ++round) {
    const float tc = time_ms([&] { cudaMemcpyAsync(cd, cs, cb, cudaMemcpyDeviceToDevice, 0); });
    printf("G%d M%lld K%lld short%d%s | copy %.3f ms %.0f GB/s", G, (long long)M, (long long)K, last_short,
           skew ? " skew" : "", tc, bytes / tc / 1e6);
    for (int col = 0; col < 2; ++col) {
      mxfp8::DequantizeArgs a;
      a.data = data; a.scale = scale; a.columnwise = col; a.swizzled = true; a.rows = T; a.cols = K; a.numel = T * K;
      a.members.rows.row = d_rows; a.members.rows.pad4 = a.members.rows.pad64 = a.members.rows.pad128 =
          a.members.rows.pad512 = d_pad;
      a.members.rows.num_tensors = G; a.out_dtype = DType::kBFloat16; a.num_tiles = P / 128 * ((K + 127) / 128);
      a.out = out0;
      auto lib = [&] { CK(mxfp8::launch_dequantize(a, 0)); };
      mxfp8::DequantizeArgs b = a; b.out = out1;
      auto old = [&] {
        if (col) stores_kernel<true><<<unsigned(b.num_tiles), 256>>>(b);
        else stores_kernel<false><<<unsigned(b.num_tiles), 256>>>(b);
      };
      if (round == 0) {
        CK(cudaMemset(out0, 0xA5, 2 * T * K)); CK(cudaMemset(out1, 0x5A, 2 * T * K));
        lib(); old(); CK(cudaDeviceSynchronize());
        std::vector<uint8_t> h0(2 * T * K), h1(2 * T * K);
        CK(cudaMemcpy(h0.data(), out0, h0.size(), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(h1.data(), out1, h1.size(), cudaMemcpyDeviceToHost));
        if (memcmp(h0.data(), h1.data(), h0.size()) != 0) printf(" | %s MISMATCH", col ? "col" : "row");
      }
      const float t_old = time_ms(old), t_lib = time_ms(lib);
      printf(" | %s: stores %.2f, lpmoe %.2f", col ? "col" : "row", tc / t_old, tc / t_lib);
    }
    printf("\n");
  }
  return 0;
}
