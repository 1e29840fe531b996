// CUTLASS sm_90 pointer-array grouped GEMM for 16-bit operands: one template,
// instantiated once per (dtype, GEMM kind) translation unit.  Layouts (CUTLASS
// convention, A is M x K, B is N x K):
//   fprop  A row-major (K-major), B column-major (K-major)      "TN"
//   dgrad  A row-major,            B row-major (N-major)         "NN"
//   wgrad  A column-major (M-major), B row-major (N-major)       "NT"
// The K-loop of wgrad runs over tokens: TMA zero-fills the partial last tile,
// so any M_t works.
#pragma once

#include "gemm/cutlass_grouped.cuh"
#include "gemm/output_tail.cuh"

namespace lpmoe {
namespace gemm {

#if LPMOE_HAS_SM90_GROUPED
namespace detail16 {

using namespace cute;

struct Cooperative16 {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
};
struct Pingpong16 {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
  using TileShape = Shape<_128, _128, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
};
// Groups of <= 128 rows on average (heuristics16.h): a 128-row tile is at
// least half empty there, so each warpgroup of the pingpong pair takes its own
// 64-row tile; the deeper K step (128) keeps the short tiles' mainloop fed.
struct Pingpong16Rows64 {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
  using TileShape = Shape<_64, _128, _128>;
  using ClusterShape = Shape<_2, _1, _1>;
};

// OutT: D's element type (void = fp32 for wgrad, the input type otherwise).
template <class Element, GemmKind Kind, class Schedule = Cooperative16, class OutT = void>
struct Config16 {
  static constexpr bool kWgrad = Kind == GemmKind::kWgrad;
  using LayoutA = std::conditional_t<kWgrad, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutB = std::conditional_t<Kind == GemmKind::kFprop, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using ElementD = std::conditional_t<!std::is_void_v<OutT>, OutT, std::conditional_t<kWgrad, float, Element>>;
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using TileShape = typename Schedule::TileShape;
  using ClusterShape = typename Schedule::ClusterShape;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, cutlass::layout::RowMajor*, kAlignD,
      ElementD, cutlass::layout::RowMajor*, kAlignD, typename Schedule::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, 8, Element, LayoutB*, 8, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<GroupShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Arrays = GroupArrays<Gemm>;
};

template <class C, class Element, GemmKind Kind>
__global__ void build_args16(GroupedGemmArgs args, typename C::Arrays arr) {
  using Arrays = typename C::Arrays;
  using ElementD = typename C::ElementD;
  const int arg_blocks = (args.num_groups + blockDim.x - 1) / blockDim.x;
  if (blockIdx.x >= arg_blocks) {  // the blocks past the arguments' zero the capacity tail
    zero_output_tail(args, blockIdx.x - arg_blocks, gridDim.x - arg_blocks);
    return;
  }
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= args.num_groups) return;
  const int64_t m = member_rows(args.rows.row, t);
  const int64_t row0 = args.rows.row[t];
  const Element* a = static_cast<const Element*>(args.a);
  if constexpr (Kind == GemmKind::kWgrad) {
    const int gm = m > 0 ? int(args.n) : 0;  // empty member: no tiles
    arr.shape[t] = ShapeMNK(gm, int(args.k), int(m));
    arr.a[t] = a + row0 * args.n;
    arr.b[t] = static_cast<const Element*>(args.b) + row0 * args.k;
    ElementD* d = static_cast<ElementD*>(args.d) + int64_t(t) * args.n * args.k;
    arr.c[t] = d;
    arr.d[t] = d;
    arr.sa[t] = make_ld_stride<typename Arrays::StrideA>(args.n);
    arr.sb[t] = make_ld_stride<typename Arrays::StrideB>(args.k);
    arr.sc[t] = make_ld_stride<typename Arrays::StrideC>(args.k);
    arr.sd[t] = make_ld_stride<typename Arrays::StrideD>(args.k);
  } else {
    constexpr bool fprop = Kind == GemmKind::kFprop;
    const int64_t red = fprop ? args.k : args.n;
    const int64_t cols = fprop ? args.n : args.k;
    arr.shape[t] = ShapeMNK(int(m), int(cols), int(red));
    arr.a[t] = a + row0 * red;
    arr.b[t] = args.b_ptrs ? reinterpret_cast<const Element*>(args.b_ptrs[t])
                           : static_cast<const Element*>(args.b) + t * args.b_member_elems;
    arr.d[t] = static_cast<ElementD*>(args.d) + row0 * cols;
    arr.sa[t] = make_ld_stride<typename Arrays::StrideA>(red);
    arr.sb[t] = make_ld_stride<typename Arrays::StrideB>(args.k);  // W_t is (N, K) row-major either way
    arr.sd[t] = make_ld_stride<typename Arrays::StrideD>(cols);
  }
}

template <class Element, GemmKind Kind, class Schedule = Cooperative16, class OutT = void>
cudaError_t run16(const GroupedGemmArgs& args) {
  using C = Config16<Element, Kind, Schedule, OutT>;
  using Kernel = typename C::Kernel;
  if (args.kind != Kind) return cudaErrorInvalidValue;
  if (args.num_groups <= 0) return cudaSuccess;
  SetupCarver carver{static_cast<char*>(args.setup)};
  auto arr = C::Arrays::carve(carver, args.num_groups);
  if (carver.used > args.setup_bytes) return cudaErrorInvalidValue;
  build_args16<C, Element, Kind><<<(args.num_groups + 127) / 128 + tail_blocks(args), 128, 0, args.stream>>>(args, arr);
  const bool acc = C::kWgrad && args.beta != 0.0f;
  typename Kernel::MainloopArguments mainloop{arr.a, arr.sa, arr.b, arr.sb};
  typename Kernel::EpilogueArguments epilogue{{}, acc ? arr.c : nullptr, arr.sc, arr.d, arr.sd};
  epilogue.thread.alpha = 1.0f;
  epilogue.thread.beta = acc ? args.beta : 0.0f;
  cudaError_t st = run_grouped<typename C::Gemm>(args, arr.shape, mainloop, epilogue);
  if (st != cudaSuccess || !C::kWgrad || acc) return st;
  return zero_empty_wgrad(args.d, sizeof(typename C::ElementD), args.rows, args.num_groups, args.n, args.k,
                          args.stream);
}

}  // namespace detail16
#endif

}  // namespace gemm
}  // namespace lpmoe

// One translation unit per (dtype, kind): defines `fn(args)` or a stub.
// Tuning builds (-DLPMOE_GEMM_EXPERIMENTS) also compile the pingpong
// schedule, picked with LPMOE_GEMM_VARIANT=pp16.
#if LPMOE_HAS_SM90_GROUPED && defined(LPMOE_GEMM_EXPERIMENTS)
#define LPMOE_DEFINE_GROUPED_16BIT(fn, element, kind)                                        \
  namespace lpmoe {                                                                         \
  namespace gemm {                                                                          \
  cudaError_t fn(const GroupedGemmArgs& args) {                                             \
    if (variant_is("pp16")) return detail16::run16<element, kind, detail16::Pingpong16>(args); \
    return detail16::run16<element, kind>(args);                                            \
  }                                                                                         \
  }                                                                                         \
  }
#elif LPMOE_HAS_SM90_GROUPED
#define LPMOE_DEFINE_GROUPED_16BIT(fn, element, kind)                                        \
  namespace lpmoe {                                                                         \
  namespace gemm {                                                                          \
  cudaError_t fn(const GroupedGemmArgs& args) { return detail16::run16<element, kind>(args); } \
  }                                                                                         \
  }
#else
#define LPMOE_DEFINE_GROUPED_16BIT(fn, element, kind)                                        \
  namespace lpmoe {                                                                         \
  namespace gemm {                                                                          \
  cudaError_t fn(const GroupedGemmArgs&) { return cudaErrorNotSupported; }                  \
  }                                                                                         \
  }
#endif

// fprop / dgrad with the 64-row tile of small groups (Pingpong16Rows64).
#if LPMOE_HAS_SM90_GROUPED
#define LPMOE_DEFINE_GROUPED_16BIT_ROWS64(fn, element, kind)                                  \
  namespace lpmoe {                                                                          \
  namespace gemm {                                                                           \
  cudaError_t fn(const GroupedGemmArgs& args) {                                              \
    return detail16::run16<element, kind, detail16::Pingpong16Rows64>(args);                 \
  }                                                                                          \
  }                                                                                          \
  }
#else
#define LPMOE_DEFINE_GROUPED_16BIT_ROWS64(fn, element, kind)                                  \
  namespace lpmoe {                                                                          \
  namespace gemm {                                                                           \
  cudaError_t fn(const GroupedGemmArgs&) { return cudaErrorNotSupported; }                   \
  }                                                                                          \
  }
#endif

// A wgrad whose D is `out` (e.g. bf16 weight gradients written directly).
#if LPMOE_HAS_SM90_GROUPED
#define LPMOE_DEFINE_GROUPED_16BIT_WGRAD_OUT(fn, element, out)                                \
  namespace lpmoe {                                                                          \
  namespace gemm {                                                                           \
  cudaError_t fn(const GroupedGemmArgs& args) {                                              \
    return detail16::run16<element, GemmKind::kWgrad, detail16::Cooperative16, out>(args);   \
  }                                                                                          \
  }                                                                                          \
  }
#else
#define LPMOE_DEFINE_GROUPED_16BIT_WGRAD_OUT(fn, element, out)                                \
  namespace lpmoe {                                                                          \
  namespace gemm {                                                                           \
  cudaError_t fn(const GroupedGemmArgs&) { return cudaErrorNotSupported; }                   \
  }                                                                                          \
  }
#endif
