// FP8 block-scaled grouped GEMM for the weight gradient: dW_t (N x K) =
// dy_t^T x_t, both operands 1x128-scaled along the token dim (their
// transposed, per-member 128-token-padded columnwise copies), fp32 out with
// optional accumulation (beta = 1).  One CUTLASS instantiation.
#include "gemm/cutlass_grouped.cuh"

namespace lpmoe {
namespace gemm {

#if LPMOE_HAS_SM90_GROUPED
namespace {

using namespace cute;

using ElementA = cutlass::float_e4m3_t;
using ElementD = float;
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _2, _1>;
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, cutlass::layout::RowMajor*, 4, ElementD,
    cutlass::layout::RowMajor*, 4, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;

using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<cutlass::layout::RowMajor*, LayoutSFA*>,
    16, ElementA, cute::tuple<cutlass::layout::ColumnMajor*, LayoutSFB*>, 16, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<GroupShape, PaddedScaleMainloop<BaseMainloop>, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
using Arrays = GroupArrays<Gemm>;

struct ScaleArrays {
  const float** sfa;
  const float** sfb;
  LayoutSFA* lsfa;
  LayoutSFB* lsfb;
};

__global__ void build_args(GroupedGemmArgs args, Arrays arr, ScaleArrays sc) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= args.num_groups) return;
  const int64_t m = member_rows(args.rows.row, t);
  const int64_t tok0 = args.rows.pad128[t];        // columnwise copies: 128-padded token offsets
  const int64_t mpad = member_rows(args.rows.pad128, t);
  // An empty member gets no tiles (M = 0); zero_empty_wgrad clears its dW.
  const int gm = m > 0 ? int(args.n) : 0;
  arr.shape[t] = ShapeMNK(gm, int(args.k), int(mpad));
  arr.a[t] = static_cast<const ElementA*>(args.a) + args.n * tok0;
  arr.b[t] = static_cast<const ElementA*>(args.b) + args.k * tok0;
  ElementD* d = static_cast<ElementD*>(args.d) + int64_t(t) * args.n * args.k;
  arr.d[t] = d;
  arr.c[t] = d;
  arr.sa[t] = make_ld_stride<Arrays::StrideA>(mpad);
  arr.sb[t] = make_ld_stride<Arrays::StrideB>(mpad);
  arr.sc[t] = make_ld_stride<Arrays::StrideC>(args.k);
  arr.sd[t] = make_ld_stride<Arrays::StrideD>(args.k);
  // (ceil(M_t/128), round_up(N,4)) and (ceil(M_t/128), round_up(K,4)) per member
  sc.sfa[t] = args.a_scale + (args.n + 3) / 4 * 4 * (tok0 / 128);
  sc.sfb[t] = args.b_scale + (args.k + 3) / 4 * 4 * (tok0 / 128);
  sc.lsfa[t] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(gm, int(args.k), int(mpad), 1));
  sc.lsfb[t] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(gm, int(args.k), int(mpad), 1));
}

}  // namespace

cudaError_t fp8_block_grouped_gemm_wgrad(const GroupedGemmArgs& args) {
  if (args.kind != GemmKind::kWgrad) return cudaErrorInvalidValue;
  if (args.num_groups <= 0) return cudaSuccess;
  SetupCarver carver{static_cast<char*>(args.setup)};
  Arrays arr = Arrays::carve(carver, args.num_groups);
  ScaleArrays sc{carver.take<const float*>(args.num_groups), carver.take<const float*>(args.num_groups),
                 carver.take<LayoutSFA>(args.num_groups), carver.take<LayoutSFB>(args.num_groups)};
  if (carver.used > args.setup_bytes) return cudaErrorInvalidValue;
  build_args<<<(args.num_groups + 127) / 128, 128, 0, args.stream>>>(args, arr, sc);
  const bool acc = args.beta != 0.0f;
  typename Kernel::MainloopArguments mainloop{arr.a, arr.sa, arr.b, arr.sb, sc.sfa, sc.lsfa, sc.sfb, sc.lsfb};
  typename Kernel::EpilogueArguments epilogue{{}, acc ? arr.c : nullptr, arr.sc, arr.d, arr.sd};
  epilogue.thread.alpha = 1.0f;
  epilogue.thread.beta = args.beta;
  cudaError_t st = run_grouped<Gemm>(args, arr.shape, mainloop, epilogue);
  if (st != cudaSuccess || acc) return st;
  return zero_empty_wgrad(static_cast<float*>(args.d), args.rows, args.num_groups, args.n, args.k, args.stream);
}

#else

cudaError_t fp8_block_grouped_gemm_wgrad(const GroupedGemmArgs&) { return cudaErrorNotSupported; }

#endif

}  // namespace gemm
}  // namespace lpmoe
