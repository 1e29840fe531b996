// Row scatter / gather kernels of the MoE token permutation (permute.h).
//
// One CTA moves one token at a time (grid-stride over tokens): the token's
// k map entries sit in shared memory, each thread loads kUnroll words of
// the source row before issuing its stores, so a 128-thread CTA keeps 8 KB
// of loads in flight.  Rows are moved as `Word`s (16 bytes when the row
// size and the pointers allow it); typed launches convert to fp32 only when
// they scale or sum.  One-column rows (a value per slot, e.g. the routing
// probabilities) take a kernel with one thread per token instead: a CTA per
// 4-byte row would leave 127 of its threads idle behind two barriers.
#include "permute/permute.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "common/numerics.cuh"

namespace lpmoe {
namespace permute {
namespace {

constexpr int kThreads = 128;
constexpr int kUnroll = 4;

// Elements of T packed in one Word, converted through fp32.
template <typename T, typename Word>
struct Lanes {
  static constexpr int N = sizeof(Word) / sizeof(T);
  __device__ __forceinline__ static void unpack(const Word& w, float (&f)[N]) {
    const T* e = reinterpret_cast<const T*>(&w);
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = to_float<T>(e[i]);
  }
  __device__ __forceinline__ static Word pack(const float (&f)[N]) {
    Word w;
    T* e = reinterpret_cast<T*>(&w);
#pragma unroll
    for (int i = 0; i < N; ++i) e[i] = from_float<T>(f[i]);
    return w;
  }
};

// The k destination rows (and scales) of token t, in shared memory; entries
// outside [0, rows) become -1.
__device__ __forceinline__ void load_map(const int32_t* row_map, const float* scale, int64_t t, int64_t k,
                                         int64_t rows, int32_t* s_rows, float* s_scale) {
  __syncthreads();  // the previous token's entries are no longer read
  for (int j = threadIdx.x; j < k; j += kThreads) {
    const int32_t r = row_map[t * k + j];
    s_rows[j] = (r >= 0 && r < rows) ? r : -1;
    if (scale != nullptr) s_scale[j] = scale[t * k + j];
  }
  __syncthreads();
}

// Sum of one value per thread over the CTA, in a fixed order (deterministic).
__device__ __forceinline__ float block_sum(float v, float* s_partial) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) s_partial[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += s_partial[w];
  return total;
}

// kTyped: T is an element type and Word packs N of them (scaling and dot
// products need it); otherwise T == Word and bytes are copied.
template <typename T, typename Word, bool kTyped, bool kScaled>
__global__ void __launch_bounds__(kThreads) scatter_kernel(ScatterArgs a) {
  using L = Lanes<T, Word>;
  __shared__ int32_t s_rows[kMaxSlots];
  __shared__ float s_scale[kMaxSlots];
  __shared__ float s_partial[kThreads / 32];
  const int64_t words = a.cols * (kTyped ? int64_t(sizeof(T)) : int64_t(a.elem_bytes)) / int64_t(sizeof(Word));
  const Word* src = static_cast<const Word*>(a.src);
  Word* dst = static_cast<Word*>(a.dst);
  for (int64_t t = blockIdx.x; t < a.tokens; t += gridDim.x) {
    load_map(a.row_map, kScaled ? a.scale : nullptr, t, a.k, a.out_rows, s_rows, s_scale);
    const Word* s = src + t * words;
    if constexpr (kTyped && kScaled) {
      if (a.dot_with != nullptr) {
        // Unpermute backward with probabilities: per slot, the scaled copy
        // and <src[t], dot_with[row]> in one sweep (src stays in L1 across
        // slots).  Per-thread partials in word order, then a fixed tree:
        // deterministic.
        const Word* other = static_cast<const Word*>(a.dot_with);
        for (int j = 0; j < a.k; ++j) {
          const int32_t r = s_rows[j];
          float acc = 0.0f;
          if (r >= 0) {
            const Word* o = other + int64_t(r) * words;
            Word* d = dst + int64_t(r) * words;
            for (int64_t w0 = threadIdx.x; w0 < words; w0 += kThreads * kUnroll) {
              Word xv[kUnroll], yv[kUnroll];
#pragma unroll
              for (int u = 0; u < kUnroll; ++u) {
                const int64_t w = w0 + u * kThreads;
                if (w < words) {
                  xv[u] = s[w];
                  yv[u] = o[w];
                }
              }
#pragma unroll
              for (int u = 0; u < kUnroll; ++u) {
                const int64_t w = w0 + u * kThreads;
                if (w >= words) break;
                float x[L::N], y[L::N];
                L::unpack(xv[u], x);
                L::unpack(yv[u], y);
#pragma unroll
                for (int i = 0; i < L::N; ++i) {
                  acc = fmaf(x[i], y[i], acc);
                  x[i] = __fmul_rn(x[i], s_scale[j]);
                }
                d[w] = L::pack(x);
              }
            }
          }
          const float total = block_sum(acc, s_partial);
          if (threadIdx.x == 0) a.dot_out[t * a.k + j] = r >= 0 ? total : 0.0f;
        }
        continue;
      }
    }
    for (int64_t w0 = threadIdx.x; w0 < words; w0 += kThreads * kUnroll) {
      Word v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t w = w0 + u * kThreads;
        if (w < words) v[u] = s[w];
      }
      for (int j = 0; j < a.k; ++j) {
        const int32_t r = s_rows[j];
        if (r < 0) continue;
        Word* d = dst + int64_t(r) * words;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t w = w0 + u * kThreads;
          if (w >= words) break;
          if constexpr (kScaled) {
            float f[L::N];
            L::unpack(v[u], f);
#pragma unroll
            for (int i = 0; i < L::N; ++i) f[i] = __fmul_rn(f[i], s_scale[j]);
            d[w] = L::pack(f);
          } else {
            d[w] = v[u];
          }
        }
      }
    }
  }
  if (a.zero_from != nullptr) {
    // Rows no slot maps to (the packed layout's tail) get zeros.
    const int64_t first = max(int64_t(0), min(*a.zero_from, a.out_rows));
    const Word zero{};
    for (int64_t r = first + blockIdx.x; r < a.out_rows; r += gridDim.x)
      for (int64_t w = threadIdx.x; w < words; w += kThreads) dst[r * words + w] = zero;
  }
}

template <typename T, typename Word, bool kScaled>
__global__ void __launch_bounds__(kThreads) gather_kernel(GatherArgs a) {
  using L = Lanes<T, Word>;
  __shared__ int32_t s_rows[kMaxSlots];
  __shared__ float s_scale[kMaxSlots];
  const int64_t words = a.cols * int64_t(sizeof(T)) / int64_t(sizeof(Word));
  const Word* src = static_cast<const Word*>(a.src);
  Word* dst = static_cast<Word*>(a.dst);
  for (int64_t t = blockIdx.x; t < a.tokens; t += gridDim.x) {
    load_map(a.row_map, kScaled ? a.scale : nullptr, t, a.k, a.src_rows, s_rows, s_scale);
    for (int64_t w0 = threadIdx.x; w0 < words; w0 += kThreads * kUnroll) {
      float acc[kUnroll][L::N];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int i = 0; i < L::N; ++i) acc[u][i] = 0.0f;
      for (int j = 0; j < a.k; ++j) {
        const int32_t r = s_rows[j];
        if (r < 0) continue;
        const Word* s = src + int64_t(r) * words;
        Word v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t w = w0 + u * kThreads;
          if (w < words) v[u] = s[w];
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          float f[L::N];
          L::unpack(v[u], f);
          // Explicit roundings: no fused multiply-add, so the CPU reference
          // (multiply, then add, in fp32) gives the same bits.
#pragma unroll
          for (int i = 0; i < L::N; ++i)
            acc[u][i] = __fadd_rn(acc[u][i], kScaled ? __fmul_rn(f[i], s_scale[j]) : f[i]);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t w = w0 + u * kThreads;
        if (w < words) dst[t * words + w] = L::pack(acc[u]);
      }
    }
  }
}

// One-column rows: thread i writes token i's k slots (and zero-fills row i
// from *zero_from on, rows the caller promises no slot maps to), or sums
// them for the gather.  Same arithmetic as the row kernels (fp32, multiply
// then add, slot order), so the same bits.
template <typename T, bool kScaled>
__global__ void __launch_bounds__(256) scatter_column_kernel(ScatterArgs a) {
  const T* src = static_cast<const T*>(a.src);
  T* dst = static_cast<T*>(a.dst);
  const int64_t first = a.zero_from != nullptr ? max(int64_t(0), min(*a.zero_from, a.out_rows)) : a.out_rows;
  const int64_t n = a.tokens > a.out_rows ? a.tokens : a.out_rows;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (i < a.tokens) {
      const T v = src[i];
      for (int64_t j = 0; j < a.k; ++j) {
        const int32_t r = a.row_map[i * a.k + j];
        if (r < 0 || r >= a.out_rows) continue;
        dst[r] = kScaled ? from_float<T>(__fmul_rn(to_float<T>(v), a.scale[i * a.k + j])) : v;
      }
    }
    if (i < a.out_rows && i >= first) dst[i] = from_float<T>(0.0f);
  }
}

template <typename T, bool kScaled>
__global__ void __launch_bounds__(256) gather_column_kernel(GatherArgs a) {
  const T* src = static_cast<const T*>(a.src);
  T* dst = static_cast<T*>(a.dst);
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < a.tokens; t += int64_t(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (int64_t j = 0; j < a.k; ++j) {
      const int32_t r = a.row_map[t * a.k + j];
      if (r < 0 || r >= a.src_rows) continue;
      const float f = to_float<T>(src[r]);
      acc = __fadd_rn(acc, kScaled ? __fmul_rn(f, a.scale[t * a.k + j]) : f);
    }
    dst[t] = from_float<T>(acc);
  }
}

int column_grid(int64_t n, int sm_count) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, int64_t(sm_count) * 16)));
}

template <typename T>
cudaError_t scatter_column(const ScatterArgs& a, int sm_count, cudaStream_t stream) {
  const int grid = column_grid(std::max(a.tokens, a.out_rows), sm_count);
  if (a.scale != nullptr) scatter_column_kernel<T, true><<<grid, 256, 0, stream>>>(a);
  else scatter_column_kernel<T, false><<<grid, 256, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t gather_column(const GatherArgs& a, int sm_count, cudaStream_t stream) {
  const int grid = column_grid(a.tokens, sm_count);
  if (a.scale != nullptr) gather_column_kernel<T, true><<<grid, 256, 0, stream>>>(a);
  else gather_column_kernel<T, false><<<grid, 256, 0, stream>>>(a);
  return cudaGetLastError();
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Widest word (16, 8, 4, 2, 1 bytes) dividing the row size and every pointer's alignment.
int word_bytes(int64_t row_bytes, std::initializer_list<const void*> ptrs) {
  for (int b : {16, 8, 4, 2}) {
    bool ok = row_bytes % b == 0;
    for (const void* p : ptrs) ok = ok && (p == nullptr || aligned(p, b));
    if (ok) return b;
  }
  return 1;
}

int grid_for(int64_t tokens, int sm_count) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(tokens, int64_t(sm_count) * 16)));
}

template <typename T, typename Word, bool kTyped>
cudaError_t scatter_as(const ScatterArgs& a, int grid, cudaStream_t stream) {
  if (a.scale != nullptr) {
    if constexpr (kTyped) scatter_kernel<T, Word, true, true><<<grid, kThreads, 0, stream>>>(a);
  } else {
    scatter_kernel<T, Word, kTyped, false><<<grid, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t scatter_typed(const ScatterArgs& a, int grid, cudaStream_t stream) {
  const bool wide = word_bytes(a.cols * int64_t(sizeof(T)), {a.src, a.dst, a.dot_with}) == 16;
  return wide ? scatter_as<T, uint4, true>(a, grid, stream) : scatter_as<T, T, true>(a, grid, stream);
}

template <typename T>
cudaError_t gather_typed(const GatherArgs& a, int grid, cudaStream_t stream) {
  const bool wide = word_bytes(a.cols * int64_t(sizeof(T)), {a.src, a.dst}) == 16;
  if (a.scale != nullptr) {
    if (wide) gather_kernel<T, uint4, true><<<grid, kThreads, 0, stream>>>(a);
    else gather_kernel<T, T, true><<<grid, kThreads, 0, stream>>>(a);
  } else {
    if (wide) gather_kernel<T, uint4, false><<<grid, kThreads, 0, stream>>>(a);
    else gather_kernel<T, T, false><<<grid, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_scatter(const ScatterArgs& a, int sm_count, cudaStream_t stream) {
  if (a.k < 1 || a.k > kMaxSlots || a.cols < 0 || a.tokens < 0) return cudaErrorInvalidValue;
  if (a.raw && (a.scale != nullptr || a.dot_with != nullptr)) return cudaErrorInvalidValue;
  if (a.cols == 0 || (a.tokens == 0 && a.zero_from == nullptr)) return cudaSuccess;
  if (a.cols == 1 && !a.raw && a.dot_with == nullptr) {
    switch (a.dtype) {
      case DType::kFloat32: return scatter_column<float>(a, sm_count, stream);
      case DType::kBFloat16: return scatter_column<__nv_bfloat16>(a, sm_count, stream);
      case DType::kFloat16: return scatter_column<__half>(a, sm_count, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  const int grid = grid_for(std::max(a.tokens, a.out_rows), sm_count);
  if (a.raw) {
    switch (word_bytes(a.cols * a.elem_bytes, {a.src, a.dst})) {
      case 16: return scatter_as<uint4, uint4, false>(a, grid, stream);
      case 8: return scatter_as<uint2, uint2, false>(a, grid, stream);
      case 4: return scatter_as<uint32_t, uint32_t, false>(a, grid, stream);
      case 2: return scatter_as<uint16_t, uint16_t, false>(a, grid, stream);
      default: return scatter_as<uint8_t, uint8_t, false>(a, grid, stream);
    }
  }
  switch (a.dtype) {
    case DType::kFloat32: return scatter_typed<float>(a, grid, stream);
    case DType::kBFloat16: return scatter_typed<__nv_bfloat16>(a, grid, stream);
    case DType::kFloat16: return scatter_typed<__half>(a, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_gather(const GatherArgs& a, int sm_count, cudaStream_t stream) {
  if (a.k < 1 || a.k > kMaxSlots || a.cols < 0 || a.tokens < 0) return cudaErrorInvalidValue;
  if (a.cols == 0 || a.tokens == 0) return cudaSuccess;
  if (a.cols == 1) {
    switch (a.dtype) {
      case DType::kFloat32: return gather_column<float>(a, sm_count, stream);
      case DType::kBFloat16: return gather_column<__nv_bfloat16>(a, sm_count, stream);
      case DType::kFloat16: return gather_column<__half>(a, sm_count, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  const int grid = grid_for(a.tokens, sm_count);
  switch (a.dtype) {
    case DType::kFloat32: return gather_typed<float>(a, grid, stream);
    case DType::kBFloat16: return gather_typed<__nv_bfloat16>(a, grid, stream);
    case DType::kFloat16: return gather_typed<__half>(a, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace permute
}  // namespace lpmoe
