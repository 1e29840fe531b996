// Which variant of the fused activation kernels a launch takes (one place).
//
// The sigmoid table (sigmoid_table.cuh) trades ~18 arithmetic instructions
// per element for one shared-memory load with bank conflicts.  That pays
// where the kernels are issue-bound and costs where they are memory-bound,
// which is a property of the device: its DRAM bandwidth per SM per cycle.
// Measured (docs/activation-notes.md, "The sigmoid from a table"), FP8
// SwiGLU at 8 x 64k tokens, F 2048, kernel time old -> table:
//   H200 (4.8 TB/s, 132 SMs at 1.98 GHz: 18.4 B per SM-cycle from the
//        attributes below): forward 270 -> 220 us, backward 511 -> 482 us;
//   H100 SXM (3.35 TB/s: ~12.8 B per SM-cycle on paper): forward
//        297 -> 314 us, backward 574 -> 587 us (0.91 / 0.78 of copy before).
// The threshold sits between the two.
#include <atomic>

#include <cuda_runtime_api.h>

#include "activation/heuristics.h"

namespace lpmoe {
namespace activation {
namespace {

constexpr double kTableFromBytesPerSmCycle = 16.0;
constexpr int kMaxDevices = 64;

std::atomic<int> g_pays[kMaxDevices] = {};  // 0 unknown, 1 no, 2 yes (a race only recomputes)
std::atomic<int64_t> g_table_launches{0};

}  // namespace

double dram_bytes_per_sm_cycle(int device) {
  int mem_khz = 0, bus_bits = 0, sm_khz = 0, sms = 0;
  if (cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sm_khz, cudaDevAttrClockRate, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    return 0.0;
  }
  if (sm_khz <= 0 || sms <= 0) return 0.0;
  const double bytes_per_s = 2.0 * mem_khz * 1e3 * (bus_bits / 8.0);  // double data rate
  return bytes_per_s / (static_cast<double>(sms) * sm_khz * 1e3);
}

bool use_sigmoid_table(const Common& c) {
  if (c.sigmoid_table != SigmoidTable::kAuto) return c.sigmoid_table == SigmoidTable::kOn;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    cudaGetLastError();
    return false;
  }
  int known = g_pays[device].load(std::memory_order_relaxed);
  if (known == 0) {
    known = dram_bytes_per_sm_cycle(device) >= kTableFromBytesPerSmCycle ? 2 : 1;
    g_pays[device].store(known, std::memory_order_relaxed);
  }
  return known == 2;
}

void count_sigmoid_table_launch() { g_table_launches.fetch_add(1, std::memory_order_relaxed); }

int64_t sigmoid_table_launches() { return g_table_launches.load(std::memory_order_relaxed); }

}  // namespace activation
}  // namespace lpmoe
