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
// The threshold sits between the two.  Not covered: a MIG instance (its SM
// count is the slice's; whether the memory attributes are is unverified) and
// parts near the threshold (H100 NVL, GH200) were never measured here;
// lpmoe.activation.kernels.SIGMOID_TABLE forces either variant.
#include <atomic>

#include <cuda_runtime_api.h>

#include "activation/heuristics.h"

namespace lpmoe {
namespace activation {
namespace {

constexpr double kTableFromBytesPerSmCycle = 16.0;
constexpr int kMaxCachedDevices = 64;

enum Decision : int { kUnknown = 0, kNo = 1, kYes = 2 };
std::atomic<int> g_decision[kMaxCachedDevices] = {};  // per device; a race only recomputes
std::atomic<int64_t> g_table_launches{0};

bool table_pays(int device) { return dram_bytes_per_sm_cycle(device) >= kTableFromBytesPerSmCycle; }

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
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();  // clear the failed query's error; the launch that follows reports its own
    return false;
  }
  if (device < 0 || device >= kMaxCachedDevices) return table_pays(device);
  int known = g_decision[device].load(std::memory_order_relaxed);
  if (known == kUnknown) {
    known = table_pays(device) ? kYes : kNo;
    g_decision[device].store(known, std::memory_order_relaxed);
  }
  return known == kYes;
}

void count_sigmoid_table_launch() { g_table_launches.fetch_add(1, std::memory_order_relaxed); }

int64_t sigmoid_table_launches() { return g_table_launches.load(std::memory_order_relaxed); }

}  // namespace activation
}  // namespace lpmoe
