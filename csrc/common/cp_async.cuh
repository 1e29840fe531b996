// Ampere+ asynchronous global -> shared copies (cp.async), used to stream the
// next tile into shared memory while the current one is processed from
// registers.  A thread that reads back only what it copied needs no barrier.
#pragma once

#include <cstdint>

namespace lpmoe {

// Copies 16 bytes; when !valid the destination is zero-filled (src-size 0),
// so out-of-range rows and columns read back as zeros.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

}  // namespace lpmoe
