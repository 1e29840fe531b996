// A/B harness for the fused activation kernels (csrc/activation; not part of
// lpmoe's build).  Compiled once against each csrc tree to compare, it runs
// the FP8 SwiGLU forward (row + col, probs) and backward (FP8 dh row + col,
// dbias, probs) on fixed pseudo-random bf16 inputs, prints each kernel's time
// as a ratio to a device copy of the same bytes (same process) and a hash of
// every output buffer, so two builds are compared for speed and bits:
//   nvcc -O3 -std=c++20 -arch=sm_90a -DNDEBUG --expt-relaxed-constexpr -prec-div=true -ftz=false \
//        -I<csrc> harness.cu <csrc>/activation/*.cu <csrc>/fp8_block/quantize.cu -o act
// (add -DLPMOE_ACT_HAS_TABLE_SWITCH for a tree with activation::SigmoidTable)
//   ./act T F G [hp] [table|notable] [once]   (tokens, ffn, members; hp: bf16
//   outputs instead of FP8; table / notable force the sigmoid table on / off,
//   the default lets the device decide; a tree without the switch ignores
//   them; once: each kernel launched once, untimed, for compute-sanitizer)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "activation/activation.h"

using namespace lpmoe;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e_), __LINE__); exit(1); } } while (0)

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double uni() { rng = rng * 6364136223846793005ull + 1442695040888963407ull; return ((rng >> 11) + 0.5) / 9007199254740992.0; }
static float gauss() { return static_cast<float>(std::sqrt(-2.0 * std::log(uni())) * std::cos(6.283185307179586 * uni())); }

template <typename T> T* dev(size_t n) { T* p; CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T))); CK(cudaMemset(p, 0xA5, std::max<size_t>(n, 1) * sizeof(T))); return p; }

static uint64_t hash(const void* d, size_t bytes) {
  std::vector<uint8_t> h(bytes);
  CK(cudaMemcpy(h.data(), d, bytes, cudaMemcpyDeviceToHost));
  uint64_t x = 1469598103934665603ull;
  for (uint8_t b : h) x = (x ^ b) * 1099511628211ull;
  return x;
}

static bool g_once = false;  // "once": every kernel launched once, untimed (compute-sanitizer runs)

template <typename F> static float median_ms(F fn, int iters = 20, int reps = 9) {
  if (g_once) { fn(); CK(cudaDeviceSynchronize()); return 1.0f; }
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn();
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a)); for (int i = 0; i < iters; ++i) fn(); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
    float ms; CK(cudaEventElapsedTime(&ms, a, b)); t.push_back(ms / iters);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// ms per launch of a short kernel, timed as a CUDA graph of 50 launches (the
// kernel is shorter than a host launch); one untimed launch with "once".
template <typename L> static float graph_ms(L launch) {
  if (g_once) return median_ms([&] { launch(cudaStream_t{}); });
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t g; cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < 50; ++i) launch(st);
  CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
  return median_ms([&] { CK(cudaGraphLaunch(ge, 0)); }, 3) / 50;
}

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? atoll(argv[1]) : 65536, F = argc > 2 ? atoll(argv[2]) : 2048;
  const int G = argc > 3 ? atoi(argv[3]) : 8;
  bool hp = false;
  int table = -1;
  for (int i = 4; i < argc; ++i) {
    if (!strcmp(argv[i], "hp")) hp = true;
    if (!strcmp(argv[i], "table")) table = 1;
    if (!strcmp(argv[i], "notable")) table = 0;
    if (!strcmp(argv[i], "once")) g_once = true;
  }
  // uniform members (the last takes the remainder), prefix arrays on the host
  std::vector<int64_t> row(G + 1), p4(G + 1), p64(G + 1), p128(G + 1), p512(G + 1);
  auto ru = [](int64_t v, int64_t m) { return (v + m - 1) / m * m; };
  for (int t = 0; t < G; ++t) {
    const int64_t m = t < G - 1 ? T / G : T - (T / G) * (G - 1);
    row[t + 1] = row[t] + m; p4[t + 1] = p4[t] + ru(m, 4); p64[t + 1] = p64[t] + ru(m, 64);
    p128[t + 1] = p128[t] + ru(m, 128); p512[t + 1] = p512[t] + ru(m, 512);
  }
  int64_t* offs = dev<int64_t>(5 * (G + 1));
  const std::vector<int64_t>* arrs[5] = {&row, &p4, &p64, &p128, &p512};
  for (int i = 0; i < 5; ++i) CK(cudaMemcpy(offs + i * (G + 1), arrs[i]->data(), (G + 1) * 8, cudaMemcpyHostToDevice));
  grouped::GroupRows gr{offs, offs + (G + 1), offs + 2 * (G + 1), offs + 3 * (G + 1), offs + 4 * (G + 1), G};
  const int64_t tiles = p128[G] / 128;

  std::vector<__nv_bfloat16> hh(T * 2 * F), hda(T * F);
  std::vector<float> hp_(T);
  for (auto& v : hh) v = __float2bfloat16(2.0f * gauss());
  for (auto& v : hda) v = __float2bfloat16(gauss());
  for (auto& v : hp_) v = static_cast<float>(uni());
  __nv_bfloat16* h = dev<__nv_bfloat16>(T * 2 * F);
  __nv_bfloat16* da = dev<__nv_bfloat16>(T * F);
  float* probs = dev<float>(T);
  CK(cudaMemcpy(h, hh.data(), hh.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(da, hda.data(), hda.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(probs, hp_.data(), T * 4, cudaMemcpyHostToDevice));

  activation::Common c;
  c.rows = T; c.ffn = F; c.probs = probs; c.group = gr; c.max_row_tiles = tiles;
#ifdef LPMOE_ACT_HAS_TABLE_SWITCH
  c.sigmoid_table = static_cast<activation::SigmoidTable>(table);
#else
  (void)table;
#endif
  auto fp8_args = [&](int64_t cols, uint8_t*& d, float*& s, uint8_t*& cd, float*& cs, float*& ws) {
    fp8_block::QuantizeArgs q;
    q.rows = T; q.cols = cols; q.group = gr; q.max_row_tiles = tiles;
    d = dev<uint8_t>(T * cols); s = dev<float>(((cols + 127) / 128) * p4[G]);
    cd = dev<uint8_t>(cols * p128[G]); cs = dev<float>(ru(cols, 4) * (p128[G] / 128));
    ws = dev<float>(tiles * cols);
    q.out_data = d; q.out_scale = s; q.out_col_data = cd; q.out_col_scale = cs;
    return q;
  };
  uint8_t *fd, *fcd, *bd, *bcd; float *fs, *fcs, *fws, *bs, *bcs, *bws;
  activation::ForwardArgs fa; fa.c = c; fa.h = h;
  activation::BackwardArgs ba; ba.c = c; ba.da = da; ba.h = h;
  __nv_bfloat16 *a_hp = nullptr, *dh_hp = nullptr;
  if (hp) {
    a_hp = dev<__nv_bfloat16>(T * F); dh_hp = dev<__nv_bfloat16>(T * 2 * F);
    fa.out = a_hp; ba.dh = dh_hp;
  } else {
    fa.fp8 = fp8_args(F, fd, fs, fcd, fcs, fws);
    ba.dh_fp8 = fp8_args(2 * F, bd, bs, bcd, bcs, bws);
    ba.dh_fp8.dbias_workspace = bws;
  }
  const int64_t fbk = (F + 127) / 128;
  float* partials = dev<float>(T * fbk);
  ba.probs_partials = partials;

  // copy rate: a 1 GiB device copy, read + write bytes
  const size_t cb = size_t(1) << 30;
  void *s0, *s1; CK(cudaMalloc(&s0, cb)); CK(cudaMalloc(&s1, cb));
  const float copy_ms = median_ms([&] { CK(cudaMemcpyAsync(s1, s0, cb, cudaMemcpyDeviceToDevice)); }, 5, 7);
  const double copy_gbs = 2.0 * cb / copy_ms / 1e6;

  auto fp8_bytes = [&](int64_t cols) { return 2.0 * T * cols + 2.0 * T * (cols / 128) * 4; };
  const double fwd_bytes = T * 4.0 * F + (hp ? 2.0 * T * F : fp8_bytes(F));
  const double bwd_bytes = T * 6.0 * F + (hp ? 4.0 * T * F : fp8_bytes(2 * F));
  const float f_ms = median_ms([&] { CK(activation::launch_forward(fa, 0)); });
  const float b_ms = median_ms([&] { CK(activation::launch_backward(ba, 0)); });
  CK(cudaDeviceSynchronize());
  printf("T=%lld F=%lld G=%d %s copy %.0f GB/s | fwd %.1f us %.3f of copy | bwd %.1f us %.3f of copy\n",
         (long long)T, (long long)F, G, hp ? "hp" : "fp8", copy_gbs, f_ms * 1e3, fwd_bytes / f_ms / 1e6 / copy_gbs,
         b_ms * 1e3, bwd_bytes / b_ms / 1e6 / copy_gbs);
  // the d probs reduction of the backward's partials (its own launch)
  float* dprobs = dev<float>(T);
  activation::ProbsGradArgs pa;
  pa.partials = partials; pa.rows = T; pa.blocks = fbk; pa.used_rows = offs + G; pa.out = dprobs;
  const float p_ms = graph_ms([&](cudaStream_t st) { CK(activation::launch_probs_grad(pa, st)); });
  CK(cudaDeviceSynchronize());
  printf("d probs reduce %.2f us (%.3f of copy) hash %016llx\n", p_ms * 1e3,
         (T * fbk * 4.0 + T * 4.0) / p_ms / 1e6 / copy_gbs, (unsigned long long)hash(dprobs, T * 4));
  if (!hp) {  // fc1's bias gradient from the backward's per-tile column sums (its own launch)
    __nv_bfloat16* dbias = dev<__nv_bfloat16>(G * 2 * F);
    fp8_block::DbiasReduceArgs ra;
    ra.workspace = bws; ra.group = gr; ra.rows = T; ra.cols = 2 * F; ra.out_dtype = DType::kBFloat16; ra.out = dbias;
    const float r_ms = graph_ms([&](cudaStream_t st) { CK(fp8_block::launch_dbias_reduce(ra, st)); });
    CK(cudaDeviceSynchronize());
    printf("dbias reduce %.2f us (%.3f of copy) hash %016llx\n", r_ms * 1e3,
           (tiles * 2.0 * F * 4 + G * 4.0 * F) / r_ms / 1e6 / copy_gbs, (unsigned long long)hash(dbias, G * 4 * F));
  }
  if (hp) {
    printf("hash fwd %016llx bwd %016llx partials %016llx\n", (unsigned long long)hash(a_hp, T * F * 2),
           (unsigned long long)hash(dh_hp, T * 4 * F), (unsigned long long)hash(partials, T * fbk * 4));
  } else {
    printf("hash fwd %016llx %016llx %016llx %016llx bwd %016llx %016llx %016llx %016llx %016llx partials %016llx\n",
           (unsigned long long)hash(fd, T * F), (unsigned long long)hash(fs, fbk * p4[G] * 4),
           (unsigned long long)hash(fcd, F * p128[G]), (unsigned long long)hash(fcs, ru(F, 4) * (p128[G] / 128) * 4),
           (unsigned long long)hash(bd, T * 2 * F), (unsigned long long)hash(bs, 2 * fbk * p4[G] * 4),
           (unsigned long long)hash(bcd, 2 * F * p128[G]), (unsigned long long)hash(bcs, ru(2 * F, 4) * (p128[G] / 128) * 4),
           (unsigned long long)hash(bws, tiles * 2 * F * 4), (unsigned long long)hash(partials, T * fbk * 4));
  }
  return 0;
}
