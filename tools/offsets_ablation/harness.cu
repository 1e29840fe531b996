// A/B timing of the splits -> offsets kernel (csrc/grouped; not part of
// lpmoe's build).  Compiled once against each csrc tree, it launches the
// kernel as lpmoe's grouped layouts do (five outputs: element offsets and
// row starts padded to 4, 64, 128 and 512, a capacity), 200 launches in a
// CUDA graph, and prints the time per launch and a hash of the outputs
// (equal hashes: same values).
//   nvcc -O3 -std=c++20 -arch=sm_90a -I<csrc> harness.cu <csrc>/grouped/splits_to_offsets.cu -o offs
//   ./offs N [int32] [once]   (N members, random sizes 0..3000, every 5th 0;
//   once: a single untimed launch, for compute-sanitizer)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <vector>

#include <cuda_runtime.h>

#include "grouped/splits_to_offsets.h"

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e_), __LINE__); exit(1); } } while (0)

int main(int argc, char** argv) {
  const int n = argc > 1 ? atoi(argv[1]) : 8;
  bool i32 = false, once = false;  // once: one launch, untimed (compute-sanitizer runs)
  for (int i = 2; i < argc; ++i) {
    i32 |= std::string_view(argv[i]) == "int32";
    once |= std::string_view(argv[i]) == "once";
  }
  std::vector<int64_t> h(n);
  uint64_t r = 12345;
  for (int i = 0; i < n; ++i) { r = r * 6364136223846793005ull + 1442695040888963407ull; h[i] = i % 5 ? (r >> 33) % 3001 : 0; }
  int64_t total = 0;
  for (auto v : h) total += v;
  void* splits;
  CK(cudaMalloc(&splits, std::max(n, 1) * 8));
  if (i32) { std::vector<int32_t> h32(h.begin(), h.end()); CK(cudaMemcpy(splits, h32.data(), n * 4, cudaMemcpyHostToDevice)); }
  else CK(cudaMemcpy(splits, h.data(), n * 8, cudaMemcpyHostToDevice));
  const int outs = 5;
  int64_t* out;
  CK(cudaMalloc(&out, (outs * (n + 1) + 1) * 8));
  lpmoe::grouped::SplitsToOffsetsArgs a;
  a.splits = splits;
  a.splits_are_int64 = !i32;
  a.num_splits = n;
  a.num_outputs = outs;
  const int64_t strides[outs] = {7168, 1, 1, 1, 1}, aligns[outs] = {1, 4, 64, 128, 512};
  for (int j = 0; j < outs; ++j) a.outputs[j] = {out + j * (n + 1), strides[j], aligns[j], false};
  a.status = out + outs * (n + 1);
  a.capacity_rows = total - total / 7;  // some members truncated
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CK(lpmoe::grouped::launch_splits_to_offsets(a, s));
  CK(cudaStreamSynchronize(s));
  if (once) {
    std::vector<int64_t> res(outs * (n + 1) + 1);
    CK(cudaMemcpy(res.data(), out, res.size() * 8, cudaMemcpyDeviceToHost));
    printf("N=%d once: status %lld, last offsets %lld %lld\n", n, static_cast<long long>(res.back()),
           static_cast<long long>(res[n]), static_cast<long long>(res[4 * (n + 1) + n]));
    return 0;
  }
  cudaGraph_t g;
  cudaGraphExec_t ge;
  const int launches = 200;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < launches; ++i) CK(lpmoe::grouped::launch_splits_to_offsets(a, s));
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> t;
  for (int rep = 0; rep < 11; ++rep) {
    CK(cudaEventRecord(e0, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms * 1000.0f / launches);
  }
  std::sort(t.begin(), t.end());
  std::vector<int64_t> res(outs * (n + 1) + 1);
  CK(cudaMemcpy(res.data(), out, res.size() * 8, cudaMemcpyDeviceToHost));
  uint64_t x = 1469598103934665603ull;
  for (int64_t v : res) x = (x ^ static_cast<uint64_t>(v)) * 1099511628211ull;
  printf("N=%d %s: %.2f us per launch (min %.2f, max %.2f) | status %lld hash %016llx\n", n, i32 ? "int32" : "int64",
         t[t.size() / 2], t.front(), t.back(), static_cast<long long>(res.back()), static_cast<unsigned long long>(x));
  return 0;
}
