// Shared machinery of the CUTLASS sm_90 pointer-array grouped GEMMs.
//
// Every instantiation lives in its own translation unit (compile time); this
// header gives them (1) the argument arrays in the caller's persistent setup
// buffer, (2) a device-side builder hook so per-group pointers, shapes and
// strides come from the device row prefix sums (no host sync, capturable),
// and (3) one run() that initializes and launches the kernel with device-only
// problem shapes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "gemm/grouped_gemm.h"

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED) && defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#define LPMOE_HAS_SM90_GROUPED 1
#else
#define LPMOE_HAS_SM90_GROUPED 0
#endif

namespace lpmoe {
namespace gemm {

using GroupShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using ShapeMNK = typename GroupShape::UnderlyingProblemShape;

inline size_t setup_array_bytes(size_t elem, int groups) { return (elem * size_t(groups) + 255) / 256 * 256; }

// Carves the setup buffer into typed per-group arrays, in a fixed order.
struct SetupCarver {
  char* base;
  size_t used = 0;
  template <class T>
  T* take(int groups) {
    T* p = reinterpret_cast<T*>(base + used);
    used += setup_array_bytes(sizeof(T), groups);
    return p;
  }
};

// FP8 block-scaled mainloop whose scale tensors use our padded leading
// dimension.  CUTLASS derives the scale layout from the problem shape with a
// leading dimension of ceil(MN / granularity); lpmoe's quantizers pad it to a
// multiple of 4 floats (16 B, the layout cuBLASLt and TMA want), so we rebuild
// the two scale tensors with that stride.  Everything else is the base.
template <class Base>
struct PaddedScaleMainloop : Base {
  using Base::Base;
  using ScaleT = typename Base::ElementBlockScale;

  template <class Layout>
  CUTE_HOST_DEVICE static auto pad_mn_stride(Layout const& l, int mn_blocks) {
    int ld = (mn_blocks + 3) / 4 * 4;
    auto s = cute::stride(l);
    return cute::make_layout(cute::shape(l), cute::make_stride(cute::get<0>(s), cute::make_stride(cute::_0{}, ld),
                                                               cute::get<2>(s)));
  }

  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, typename Base::Params const& params,
                                ScaleT const* ptr_SFA = nullptr, ScaleT const* ptr_SFB = nullptr) const {
    auto base = Base::load_init(problem_shape_MNKL, params, ptr_SFA, ptr_SFB);
    constexpr int gm = Base::ScaleGranularityM;  // by value: no ODR-use in device code
    constexpr int gn = Base::ScaleGranularityN;
    const int m = int(cute::get<0>(problem_shape_MNKL));
    const int n = int(cute::get<1>(problem_shape_MNKL));
    auto la = pad_mn_stride(cute::layout(cute::get<2>(base)), (m + gm - 1) / gm);
    auto lb = pad_mn_stride(cute::layout(cute::get<3>(base)), (n + gn - 1) / gn);
    return cute::make_tuple(cute::get<0>(base), cute::get<1>(base),
                            cute::make_tensor(cute::make_gmem_ptr(ptr_SFA), la),
                            cute::make_tensor(cute::make_gmem_ptr(ptr_SFB), lb));
  }

  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const&, typename Base::Params const& params,
                                                     ProblemShape_MNKL problem_shape_mnkl, int32_t next_batch) {
    return load_init(problem_shape_mnkl, params, params.ptr_SFA[next_batch], params.ptr_SFB[next_batch]);
  }
};

// Per-group argument arrays of a grouped GEMM type.
template <class Gemm>
struct GroupArrays {
  using Kernel = typename Gemm::GemmKernel;
  using ElementA = typename Kernel::ElementA;
  using ElementB = typename Kernel::ElementB;
  using ElementC = typename Kernel::ElementC;
  using ElementD = typename Kernel::ElementD;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;

  ShapeMNK* shape;
  const ElementA** a;
  const ElementB** b;
  const ElementC** c;
  ElementD** d;
  StrideA* sa;
  StrideB* sb;
  StrideC* sc;
  StrideD* sd;

  static GroupArrays carve(SetupCarver& c, int g) {
    GroupArrays r;
    r.shape = c.take<ShapeMNK>(g);
    r.a = c.take<const ElementA*>(g);
    r.b = c.take<const ElementB*>(g);
    r.c = c.take<const ElementC*>(g);
    r.d = c.take<ElementD*>(g);
    r.sa = c.take<StrideA>(g);
    r.sb = c.take<StrideB>(g);
    r.sc = c.take<StrideC>(g);
    r.sd = c.take<StrideD>(g);
    return r;
  }
};

// Row-major 2-D stride of a rank-3 CuTe stride (m, k, l) / (n, k, l) type with
// `ld` elements between rows of the contiguous-last-dim view: whichever of the
// first two modes is dynamic takes ld.
template <class Stride>
CUTE_HOST_DEVICE Stride make_ld_stride(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_integral<cute::remove_cvref_t<decltype(cute::get<0>(s))>>::value &&
                !cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(s))>>::value) {
    cute::get<0>(s) = ld;
  } else {
    cute::get<1>(s) = ld;
  }
  return s;
}

// Launches `Gemm` with device-only problem shapes (the arrays were written by
// the caller's build kernel on the same stream).
template <class Gemm, class Mainloop_Args, class Epilogue_Args>
cudaError_t run_grouped(const GroupedGemmArgs& args, ShapeMNK* shapes, Mainloop_Args mainloop,
                        Epilogue_Args epilogue) {
  using Kernel = typename Gemm::GemmKernel;
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = args.sm_count;
  typename Gemm::Arguments arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                     {args.num_groups, shapes, nullptr},
                                     mainloop,
                                     epilogue,
                                     hw};
  using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
  arguments.scheduler.raster_order = Raster::Heuristic;
  arguments.scheduler.max_swizzle_size = 1;
#ifdef LPMOE_GEMM_EXPERIMENTS
  // Tile order knobs of the tuning build: LPMOE_GEMM_SWIZZLE=<1|2|4|8>, LPMOE_GEMM_RASTER=<M|N>.
  if (const char* sw = std::getenv("LPMOE_GEMM_SWIZZLE")) arguments.scheduler.max_swizzle_size = std::atoi(sw);
  if (const char* r = std::getenv("LPMOE_GEMM_RASTER"))
    arguments.scheduler.raster_order = r[0] == 'M' ? Raster::AlongM : r[0] == 'N' ? Raster::AlongN : Raster::Heuristic;
#endif
  Gemm gemm;
  if (Gemm::get_workspace_size(arguments) > args.workspace_bytes) return cudaErrorInvalidValue;
  if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (gemm.initialize(arguments, args.workspace, args.stream) != cutlass::Status::kSuccess)
    return cudaErrorUnknown;
  if (gemm.run(args.stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  return cudaGetLastError();
}

// Tuning builds (-DLPMOE_GEMM_EXPERIMENTS) compile extra configurations and
// pick one with LPMOE_GEMM_VARIANT=<name>; release builds have one each.
inline bool variant_is(const char* name) {
  const char* v = std::getenv("LPMOE_GEMM_VARIANT");
  return v != nullptr && std::strcmp(v, name) == 0;
}

__device__ inline int64_t member_rows(const int64_t* prefix, int t) { return prefix[t + 1] - prefix[t]; }

}  // namespace gemm
}  // namespace lpmoe
