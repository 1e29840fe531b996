// Shared by the dequantize ablation harnesses (not part of lpmoe): error
// check, event timing, and the grouped member rows of a harness call.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("ERR %s line %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

// Median ms per call of f over reps samples of iters back-to-back calls, after 3 warm-up calls.
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

// Row prefix sums (G + 1) of G members of M tokens, or with `skew` 90 % of
// the G x M tokens in member 0 and the rest spread evenly (the benchmarks'
// skewed members), last_short tokens taken off the last member; and the
// members' 128-row padded prefix sums.
inline void member_rows(int G, int64_t M, int last_short, bool skew, std::vector<int64_t>& rows,
                        std::vector<int64_t>& pad) {
  rows.assign(G + 1, 0);
  pad.assign(G + 1, 0);
  for (int t = 0; t <= G; ++t) {
    const int64_t big = G * M * 9 / 10, rest = G > 1 ? (G * M - big) / (G - 1) : 0;
    rows[t] = !skew ? t * M : t == 0 ? 0 : t == G ? G * M : big + (t - 1) * rest;
    if (t == G) rows[t] -= last_short;
  }
  for (int t = 1; t <= G; ++t) pad[t] = pad[t - 1] + (rows[t] - rows[t - 1] + 127) / 128 * 128;
}
