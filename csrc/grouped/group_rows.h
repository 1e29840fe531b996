// Member row layout shared by the grouped kernels of every format (plain
// header: usable from launchers and bindings).
#pragma once

#include <cstdint>

namespace lpmoe {
namespace grouped {

// Row prefix sums of a same-shape or varying-first group, N+1 entries each:
// row[t] = sum_{i<t} M_i and padN[t] = sum_{i<t} round_up(M_i, N).  All null
// = a single member spanning every row.
struct GroupRows {
  const int64_t* row = nullptr;
  const int64_t* pad4 = nullptr;
  const int64_t* pad64 = nullptr;
  const int64_t* pad128 = nullptr;
  const int64_t* pad512 = nullptr;
  int num_tensors = 1;
};

}  // namespace grouped
}  // namespace lpmoe
