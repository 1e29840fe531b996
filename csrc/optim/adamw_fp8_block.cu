// The fused AdamW + FP8 128x128 quantization kernel (adamw_fp8_block.h).
//
// One CTA per 128x128 tile of one member, threads laid out as in
// fp8_block/tile_quantize.cuh (thread (c, g) owns rows 8g..8g+7, columns
// 8c..8c+7): each thread updates its 64 weights, keeps the new values in
// registers (as the parameter's dtype stores them), and process_tile turns
// the tile into FP8 rowwise + transposed data with the scales, exactly as
// the grouped quantize kernel does for a parameter of that dtype.
#include <atomic>

#include "common/cuda_utils.h"
#include "fp8_block/tile_quantize.cuh"
#include "optim/adamw_fp8_block.h"

namespace lpmoe {
namespace optim {
namespace {

using fp8_block::kRowsPerThread;
using fp8_block::kThreads;
using fp8_block::kVec;
using fp8_block::Smem;
using grouped::kTile;
using grouped::TileInfo;

// Members per launch: the pointer tables travel as kernel parameters
// (5 x 64 x 8 bytes), so no table is copied to the device per step.
constexpr int kMembersPerLaunch = 64;

struct MemberTables {
  void* params[kMembersPerLaunch];
  const void* grads[kMembersPerLaunch];
  float* masters[kMembersPerLaunch];  // unused for fp32 parameters
  float* exp_avgs[kMembersPerLaunch];
  float* exp_avg_sqs[kMembersPerLaunch];
};

struct KernelParams {
  MemberTables m;
  int first_member;        // global index of m's entry 0
  int64_t rows, cols;
  AdamWScalars s;
  fp8_block::QuantizeArgs q;
};

std::atomic<int64_t> g_launches{0};

// One element, in the order the header writes down (explicit _rn
// intrinsics: no FMA contraction, whatever the compiler flags).
__device__ __forceinline__ float adamw_element(const AdamWScalars& s, float p, float g, float& m, float& v) {
  p = __fmul_rn(p, s.decay);
  m = __fadd_rn(__fmul_rn(s.beta1, m), __fmul_rn(s.one_minus_beta1, g));
  v = __fadd_rn(__fmul_rn(s.beta2, v), __fmul_rn(s.one_minus_beta2, __fmul_rn(g, g)));
  const float den = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bias_correction2_sqrt), s.eps);
  return __fsub_rn(p, __fdiv_rn(__fmul_rn(s.step_size, m), den));
}

__device__ __forceinline__ void load8(const float* p, float (&x)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

__device__ __forceinline__ void store8(float* p, const float (&x)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
}

// 8 gradients of dtype T as fp32 (16-bit values widen exactly).
template <typename T>
__device__ __forceinline__ void load_grad8(const T* p, float (&x)[8]) {
  if constexpr (sizeof(T) == 4) {
    load8(reinterpret_cast<const float*>(p), x);
  } else {
    RawVec8<T> raw;
    load_vec8<T>(p, raw);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = elem<T>(raw, e);
  }
}

// The 8 updated weights as a parameter of dtype T holds them (16-bit types:
// rounded to nearest even), which is also what process_tile quantizes.
template <typename T>
__device__ __forceinline__ void pack8(const float (&x)[8], RawVec8<T>& raw) {
  if constexpr (sizeof(T) == 4) {
    raw.w[0] = make_uint4(__float_as_uint(x[0]), __float_as_uint(x[1]), __float_as_uint(x[2]), __float_as_uint(x[3]));
    raw.w[1] = make_uint4(__float_as_uint(x[4]), __float_as_uint(x[5]), __float_as_uint(x[6]), __float_as_uint(x[7]));
  } else {
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int k = 0; k < 8; ++k) e[k] = from_float<T>(x[k]);
  }
}

// PType: the parameters' and gradients' dtype; 16-bit ones step fp32 masters.
template <typename PType, bool kE5M2>
__global__ void __launch_bounds__(kThreads, 2) adamw_fp8_block_kernel(const KernelParams kp) {
  constexpr bool kMaster = sizeof(PType) != 4;
  __shared__ Smem sm;
  const int64_t N = kp.rows;
  const int64_t K = kp.cols;
  const int bx_count = static_cast<int>(ceil_div<int64_t>(K, kTile));
  const int64_t tiles_per_member = ceil_div<int64_t>(N, kTile);
  const int tile_x = static_cast<int>(blockIdx.x % bx_count);
  const int64_t jl = blockIdx.x / bx_count;  // tile row inside this launch's members
  const int local = static_cast<int>(jl / tiles_per_member);
  const int t = kp.first_member + local;

  // The tile in the grouped layout of equal members (what locate_tile reads
  // from the offsets arrays, computed: every member has N rows).
  TileInfo ti;
  ti.member = t;
  ti.local_tile = jl % tiles_per_member;
  ti.m = N;
  ti.row0 = t * N + ti.local_tile * kTile;
  ti.pad4_start = t * round_up<int64_t>(N, 4);
  ti.pad64_start = t * round_up<int64_t>(N, 64);
  ti.pad128_start = t * round_up<int64_t>(N, kTile);
  ti.pad512_start = t * round_up<int64_t>(N, 512);
  const int64_t left = N - ti.local_tile * kTile;
  ti.rows_valid = static_cast<int>(left < kTile ? left : kTile);
  const int64_t j = ti.pad128_start / kTile + ti.local_tile;

  const int64_t col0 = static_cast<int64_t>(tile_x) * kTile;
  const int c = threadIdx.x & 15;
  const int g = threadIdx.x >> 4;
  const bool col_ok = c * kVec < K - col0;
  const int64_t first = (ti.local_tile * kTile + g * kRowsPerThread) * K + col0 + c * kVec;
  PType* param = static_cast<PType*>(kp.m.params[local]) + first;
  const PType* grad = static_cast<const PType*>(kp.m.grads[local]) + first;
  // the fp32 values stepped: the master weights, or the fp32 parameters
  float* value = kMaster ? kp.m.masters[local] + first : reinterpret_cast<float*>(param);
  float* exp_avg = kp.m.exp_avgs[local] + first;
  float* exp_avg_sq = kp.m.exp_avg_sqs[local] + first;

  RawVec8<PType> raw[kRowsPerThread];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    if (col_ok && g * kRowsPerThread + r < ti.rows_valid) {
      const int64_t o = r * K;
      float p[8], gr[8], m[8], v[8];
      load8(value + o, p);
      load_grad8<PType>(grad + o, gr);
      load8(exp_avg + o, m);
      load8(exp_avg_sq + o, v);
#pragma unroll
      for (int e = 0; e < 8; ++e) p[e] = adamw_element(kp.s, p[e], gr[e], m[e], v[e]);
      store8(value + o, p);
      store8(exp_avg + o, m);
      store8(exp_avg_sq + o, v);
      pack8<PType>(p, raw[r]);
      if constexpr (kMaster) *reinterpret_cast<uint4*>(param + o) = raw[r].w[0];
    } else {
      zero_vec8<PType>(raw[r]);
    }
  }
  fp8_block::process_tile<PType, kE5M2, 2>(kp.q, ti, j, tile_x, raw, sm);
}

template <typename PType>
cudaError_t launch_typed(const KernelParams& kp, unsigned grid, bool e5m2, cudaStream_t stream) {
  if (e5m2) {
    adamw_fp8_block_kernel<PType, true><<<grid, kThreads, 0, stream>>>(kp);
  } else {
    adamw_fp8_block_kernel<PType, false><<<grid, kThreads, 0, stream>>>(kp);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_adamw_fp8_block(const AdamWFp8BlockArgs& a, cudaStream_t stream) {
  if (a.num_tensors <= 0 || a.rows <= 0 || a.cols <= 0) return cudaSuccess;
  if (a.cols % 16 != 0) return cudaErrorInvalidValue;
  const bool master = a.dtype != DType::kFloat32;
  if (master != (a.masters != nullptr)) return cudaErrorInvalidValue;
  if (a.dtype != DType::kFloat32 && a.dtype != DType::kBFloat16 && a.dtype != DType::kFloat16)
    return cudaErrorInvalidValue;
  const int64_t bx_count = ceil_div<int64_t>(a.cols, kTile);
  const int64_t tiles_per_member = ceil_div<int64_t>(a.rows, kTile);
  KernelParams kp;
  kp.rows = a.rows;
  kp.cols = a.cols;
  kp.s = a.scalars;
  kp.q = a.quantized;
  kp.q.cols = a.cols;
  kp.q.rows = static_cast<int64_t>(a.num_tensors) * a.rows;
  kp.q.block_dim = 2;
  kp.q.pad_columnwise_tokens = true;
  kp.q.noop = nullptr;
  kp.q.dbias_workspace = nullptr;
  kp.q.row_source = nullptr;
  for (int first = 0; first < a.num_tensors; first += kMembersPerLaunch) {
    const int count = a.num_tensors - first < kMembersPerLaunch ? a.num_tensors - first : kMembersPerLaunch;
    for (int i = 0; i < count; ++i) {
      kp.m.params[i] = a.params[first + i];
      kp.m.grads[i] = a.grads[first + i];
      kp.m.masters[i] = master ? a.masters[first + i] : nullptr;
      kp.m.exp_avgs[i] = a.exp_avgs[first + i];
      kp.m.exp_avg_sqs[i] = a.exp_avg_sqs[first + i];
    }
    kp.first_member = first;
    const int64_t grid = count * tiles_per_member * bx_count;
    if (grid > 0x7fffffff) return cudaErrorInvalidConfiguration;
    const unsigned blocks = static_cast<unsigned>(grid);
    const cudaError_t err =
        a.dtype == DType::kFloat32    ? launch_typed<float>(kp, blocks, a.quantized.e5m2, stream)
        : a.dtype == DType::kBFloat16 ? launch_typed<__nv_bfloat16>(kp, blocks, a.quantized.e5m2, stream)
                                      : launch_typed<__half>(kp, blocks, a.quantized.e5m2, stream);
    if (err != cudaSuccess) return err;
    g_launches.fetch_add(1, std::memory_order_relaxed);
  }
  return cudaSuccess;
}

int64_t adamw_fp8_block_launches() { return g_launches.load(std::memory_order_relaxed); }

}  // namespace optim
}  // namespace lpmoe
