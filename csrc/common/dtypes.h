// Element types crossing the launcher boundary (no torch types in kernels).
#pragma once

namespace lpmoe {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat8E4M3 = 3, kFloat8E5M2 = 4 };

}  // namespace lpmoe
