// What the GPU's fp32 multiply returns for NaN operands (docs/perf-notes.md,
// issue 13 stop 59: e2m1_pack8 takes a product's sign bit as the code's sign,
// which is right only if a product is never a negative NaN).  On the H100
// every line printed 7fffffff.
//   nvcc -arch=sm_90a -o /tmp/nan_probe tools/probe_nan_products.cu && /tmp/nan_probe
#include <cstdio>
#include <cstdint>
#include <cstring>
__global__ void k(const uint32_t* in, const float* m, uint32_t* out, int n) {
  int i = threadIdx.x;
  if (i < n) { out[2*i] = __float_as_uint(__fmul_rn(__uint_as_float(in[i]), m[i])); out[2*i+1] = __float_as_uint(fminf(__uint_as_float(in[i]), 6.0f)); }
}
int main() {
  const int n = 8;
  uint32_t h_in[n] = {0xFFC00001u, 0xFFC00000u, 0x7FC00001u, 0xFF800001u, 0x7F800001u, 0xFFFFFFFFu, 0xFFC00001u, 0xFFC00001u};
  float h_m[n] = {2.0f, 1.0f, 3.0f, 2.0f, 2.0f, 0.5f, 1e-30f, 3e38f};
  uint32_t *d_in, *d_out; float* d_m; uint32_t h_out[2*n];
  cudaMalloc(&d_in, sizeof h_in); cudaMalloc(&d_m, sizeof h_m); cudaMalloc(&d_out, sizeof h_out);
  cudaMemcpy(d_in, h_in, sizeof h_in, cudaMemcpyHostToDevice); cudaMemcpy(d_m, h_m, sizeof h_m, cudaMemcpyHostToDevice);
  k<<<1, 32>>>(d_in, d_m, d_out, n); cudaMemcpy(h_out, d_out, sizeof h_out, cudaMemcpyDeviceToHost);
  for (int i = 0; i < n; ++i) printf("in %08x * %g -> %08x ; fminf(in, 6) -> %08x\n", h_in[i], h_m[i], h_out[2*i], h_out[2*i+1]);
  return 0;
}
