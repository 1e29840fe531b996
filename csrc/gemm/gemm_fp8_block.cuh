// CUTLASS sm_90 pointer-array grouped GEMM for FP8 block scaling: one
// template, instantiated in fp8_block_1x128_128x128.cu (fprop/dgrad: A 1x128,
// B 128x128, bf16 out) and fp8_block_wgrad.cu (A and B 1x128 along the
// token dim, fp32 out).  Both operands are K-major (Hopper FP8 wgmma); the
// scales keep lpmoe's padded leading dimension (PaddedScaleMainloop).
#pragma once

#include "gemm/cutlass_grouped.cuh"
#include "gemm/output_tail.cuh"
#include "gemm_tuning/tuning.h"

namespace lpmoe {
namespace gemm {

#if LPMOE_HAS_SM90_GROUPED
namespace detail8 {

using namespace cute;

struct Cooperative {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Pingpong {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// OutT: D's element type (void = fp32 for wgrad, bf16 otherwise).
template <bool Wgrad, class Schedule, class TileShape, class ClusterShape, class OutT = void>
struct Config8 {
  static constexpr bool kWgrad = Wgrad;
  using ElementA = cutlass::float_e4m3_t;
  using ElementD = std::conditional_t<!std::is_void_v<OutT>, OutT,
                                      std::conditional_t<Wgrad, float, cutlass::bfloat16_t>>;
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, Wgrad ? 1 : 128, 128>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, cutlass::layout::RowMajor*, kAlignD,
      ElementD, cutlass::layout::RowMajor*, kAlignD, typename Schedule::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;

  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<cutlass::layout::RowMajor*, LayoutSFA*>, 16, ElementA,
      cute::tuple<cutlass::layout::ColumnMajor*, LayoutSFB*>, 16, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<GroupShape, PaddedScaleMainloop<BaseMainloop>, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Arrays = GroupArrays<Gemm>;

  struct ScaleArrays {
    const float** sfa;
    const float** sfb;
    LayoutSFA* lsfa;
    LayoutSFB* lsfb;
  };
};

// Per-group arguments.  fprop: A = x rows (M_t, K), B = W_t rowwise (N, K),
// scales: x's 1x128 rowwise, W's columnwise (N-major) 128x128.  dgrad: A = dy
// (M_t, N), B = W_t^T columnwise (K, round_up(N,128)), W's rowwise scales.
// wgrad: A = dy^T, B = x^T from the columnwise copies (token dim padded per
// member to 128, base K * pad128[t]), scales (ceil(M_t/128), round_up(dim,4)).
template <class C>
__global__ void build_args8(GroupedGemmArgs args, typename C::Arrays arr, typename C::ScaleArrays sc) {
  using Arrays = typename C::Arrays;
  using ElementA = typename C::ElementA;
  using ElementD = typename C::ElementD;
  const int arg_blocks = (args.num_groups + blockDim.x - 1) / blockDim.x;
  if (blockIdx.x >= arg_blocks) {  // the blocks past the arguments' zero the capacity tail
    zero_output_tail(args, blockIdx.x - arg_blocks, gridDim.x - arg_blocks);
    return;
  }
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= args.num_groups) return;
  const int64_t m = member_rows(args.rows.row, t);
  int gm, gn, gk;
  if constexpr (C::kWgrad) {
    const int64_t tok0 = args.rows.pad128[t];
    const int64_t mpad = member_rows(args.rows.pad128, t);
    gm = m > 0 ? int(args.n) : 0;  // an empty member gets no tiles; zero_empty_wgrad clears it
    gn = int(args.k);
    gk = int(mpad);
    arr.a[t] = static_cast<const ElementA*>(args.a) + args.n * tok0;
    arr.b[t] = static_cast<const ElementA*>(args.b) + args.k * tok0;
    ElementD* d = static_cast<ElementD*>(args.d) + int64_t(t) * args.n * args.k;
    arr.c[t] = d;
    arr.d[t] = d;
    arr.sa[t] = make_ld_stride<typename Arrays::StrideA>(mpad);
    arr.sb[t] = make_ld_stride<typename Arrays::StrideB>(mpad);
    arr.sc[t] = make_ld_stride<typename Arrays::StrideC>(args.k);
    arr.sd[t] = make_ld_stride<typename Arrays::StrideD>(args.k);
    sc.sfa[t] = args.a_scale + (args.n + 3) / 4 * 4 * (tok0 / 128);
    sc.sfb[t] = args.b_scale + (args.k + 3) / 4 * 4 * (tok0 / 128);
  } else {
    const bool fprop = args.kind == GemmKind::kFprop;
    const int64_t red = fprop ? args.k : args.n;
    const int64_t cols = fprop ? args.n : args.k;
    const int64_t row0 = args.rows.row[t];
    const int64_t ldb = fprop ? args.k : (args.n + 127) / 128 * 128;
    gm = int(m);
    gn = int(cols);
    gk = int(red);
    arr.a[t] = static_cast<const ElementA*>(args.a) + row0 * red;
    const char* b = args.b_ptrs ? reinterpret_cast<const char*>(args.b_ptrs[t])
                                : static_cast<const char*>(args.b) + t * args.b_member_elems;
    arr.b[t] = reinterpret_cast<const ElementA*>(b);
    arr.d[t] = static_cast<ElementD*>(args.d) + row0 * cols;
    arr.sa[t] = make_ld_stride<typename Arrays::StrideA>(red);
    arr.sb[t] = make_ld_stride<typename Arrays::StrideB>(ldb);
    arr.sd[t] = make_ld_stride<typename Arrays::StrideD>(cols);
    sc.sfa[t] = args.a_scale + (red + 127) / 128 * args.rows.pad4[t];
    sc.sfb[t] = args.b_scale + t * args.b_scale_member_elems;
  }
  arr.shape[t] = ShapeMNK(gm, gn, gk);
  sc.lsfa[t] = C::ScaleConfig::tile_atom_to_shape_SFA(make_shape(gm, gn, gk, 1));
  sc.lsfb[t] = C::ScaleConfig::tile_atom_to_shape_SFB(make_shape(gm, gn, gk, 1));
}

template <class C>
cudaError_t run8(const GroupedGemmArgs& args) {
  using Kernel = typename C::Kernel;
  if ((args.kind == GemmKind::kWgrad) != C::kWgrad) return cudaErrorInvalidValue;
  if (args.num_groups <= 0) return cudaSuccess;
  const int g = args.num_groups;
  SetupCarver carver{static_cast<char*>(args.setup)};
  auto arr = C::Arrays::carve(carver, g);
  typename C::ScaleArrays sc{carver.take<const float*>(g), carver.take<const float*>(g),
                             carver.take<typename C::LayoutSFA>(g), carver.take<typename C::LayoutSFB>(g)};
  if (carver.used > args.setup_bytes) return cudaErrorInvalidValue;
  build_args8<C><<<(g + 127) / 128 + tail_blocks(args), 128, 0, args.stream>>>(args, arr, sc);
  const bool acc = C::kWgrad && args.beta != 0.0f;
  typename Kernel::MainloopArguments mainloop{arr.a, arr.sa, arr.b, arr.sb, sc.sfa, sc.lsfa, sc.sfb, sc.lsfb};
  typename Kernel::EpilogueArguments epilogue{{}, acc ? arr.c : nullptr, arr.sc, arr.d, arr.sd};
  epilogue.thread.alpha = 1.0f;
  epilogue.thread.beta = acc ? args.beta : 0.0f;
  cudaError_t st = run_grouped<typename C::Gemm>(args, arr.shape, mainloop, epilogue);
  if (st != cudaSuccess || !C::kWgrad || acc) return st;
  return zero_empty_wgrad(args.d, sizeof(typename C::ElementD), args.rows, g, args.n, args.k, args.stream);
}

// A release entry point: runs `C`, or in a tuning build the configuration
// LPMOE_GEMM_VARIANT names for this kind and output type.
template <class C>
cudaError_t run8_release(const GroupedGemmArgs& args) {
#ifdef LPMOE_GEMM_EXPERIMENTS
  cudaError_t st;
  if (tuning::run_fp8_variant(args, std::is_same_v<typename C::ElementD, float>, &st)) return st;
#endif
  return run8<C>(args);
}

}  // namespace detail8
#endif

}  // namespace gemm
}  // namespace lpmoe
