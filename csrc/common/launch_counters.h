// Launches of each kernel of a family since the process started, so tests
// can prove which kernel a call took (a silent fallback then fails).  Kind:
// an enum class whose last enumerator is kCount.  Host code; relaxed
// atomics (counts only, no ordering).
#pragma once

#include <atomic>
#include <cstdint>

namespace lpmoe {

template <typename Kind>
class LaunchCounters {
 public:
  void count(Kind kind) { counts_[static_cast<int>(kind)].fetch_add(1, std::memory_order_relaxed); }
  int64_t get(Kind kind) const {
    const int k = static_cast<int>(kind);
    return k >= 0 && k < kKinds ? counts_[k].load(std::memory_order_relaxed) : 0;
  }

 private:
  static constexpr int kKinds = static_cast<int>(Kind::kCount);
  std::atomic<int64_t> counts_[kKinds] = {};
};

}  // namespace lpmoe
