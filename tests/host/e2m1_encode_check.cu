// Host program for tests/test_e2m1_encode.py: lpmoe's E2M1 encode
// (common/mx_numerics.cuh, the code NVFP4 quantize runs on the GPU) against
// formats.md §0's definition, the count of rounding thresholds below |y|,
// for every fp32 bit pattern but the signalling NaNs (the GPU encodes a
// product, which is never one), and e2m1_pack8 against eight single
// encodes on values a product can be (any sign, +NaN: the GPU's multiply
// makes every NaN +NaN).  Prints "ok" or the first mismatches; exit
// status 1 on any.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <thread>

#include "common/mx_numerics.cuh"

namespace {

uint32_t by_thresholds(float y) {
  if (std::isnan(y)) return 7;  // NaN -> +6
  const float a = std::fabs(y);
  const uint32_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return (std::signbit(y) ? 8u : 0u) | code;
}

float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

bool signalling_nan(uint32_t b) { return (b & 0x7F800000u) == 0x7F800000u && (b & 0x7FFFFFu) && !(b & 0x400000u); }

void scan(uint64_t first, uint64_t last, uint64_t* bad) {
  for (uint64_t u = first; u < last; ++u) {
    const uint32_t b = static_cast<uint32_t>(u);
    if (signalling_nan(b)) continue;
    const uint32_t got = lpmoe::e2m1_encode(from_bits(b)), want = by_thresholds(from_bits(b));
    if (got != want && ++*bad <= 5) std::printf("encode %08x: %u, expected %u\n", b, got, want);
  }
}

}  // namespace

int main() {
  uint64_t bad[2] = {0, 0};
  std::thread half(scan, 0ull, 1ull << 31, &bad[0]);
  scan(1ull << 31, 1ull << 32, &bad[1]);
  half.join();
  // pack8: eight values spread over the code table's ties and signs.
  uint64_t bad_pack = 0;
  uint32_t state = 12345;
  for (int t = 0; t < 1 << 20; ++t) {
    float v[8];
    uint32_t want = 0;
    for (int e = 0; e < 8; ++e) {
      state = state * 1664525u + 1013904223u;
      const uint32_t r = state >> 8;
      v[e] = (r & 1 ? -1.0f : 1.0f) * static_cast<float>(r >> 1 & 0x3FFF) * (1.0f / 2048.0f);  // 0 .. 8, steps of 2^-11
      if ((r & 0xFF) == 7) v[e] = NAN;
      want |= lpmoe::e2m1_encode(v[e]) << (4 * e);
    }
    const uint32_t got = lpmoe::e2m1_pack8([&](int e) { return v[e]; });
    if (got != want && ++bad_pack <= 5) std::printf("pack8: %08x, expected %08x\n", got, want);
  }
  const uint64_t total = bad[0] + bad[1] + bad_pack;
  std::printf(total ? "mismatches: %llu\n" : "ok\n", static_cast<unsigned long long>(total));
  return total ? 1 : 0;
}
