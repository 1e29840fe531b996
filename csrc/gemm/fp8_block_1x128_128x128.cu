// FP8 block-scaled grouped GEMM, 1x128 activations x 128x128 weights (fprop
// and dgrad), bf16 out.  One CUTLASS instantiation: sm_90 pointer-array,
// warp-specialized cooperative, TMA, per-128-K promotion into fp32.
#include "gemm/cutlass_grouped.cuh"

namespace lpmoe {
namespace gemm {

#if LPMOE_HAS_SM90_GROUPED
namespace {

using namespace cute;

using ElementA = cutlass::float_e4m3_t;  // E4M3 operands (the E4M3 recipe); E5M2 goes through cuBLASLt
using ElementD = cutlass::bfloat16_t;
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _2, _1>;
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, cutlass::layout::RowMajor*, 8, ElementD,
    cutlass::layout::RowMajor*, 8, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
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
  const bool fprop = args.kind == GemmKind::kFprop;
  const int64_t red = fprop ? args.k : args.n;     // contraction dim
  const int64_t out_cols = fprop ? args.n : args.k;
  const int64_t m = member_rows(args.rows.row, t);
  const int64_t row0 = args.rows.row[t];
  const int64_t red_blocks = (red + 127) / 128;
  // dgrad's B is the transposed weight, its token... its N dim padded to 128.
  const int64_t ldb = fprop ? args.k : (args.n + 127) / 128 * 128;

  arr.shape[t] = ShapeMNK(int(m), int(out_cols), int(red));
  arr.a[t] = static_cast<const ElementA*>(args.a) + row0 * red;
  const char* b = args.b_ptrs ? reinterpret_cast<const char*>(args.b_ptrs[t])
                              : static_cast<const char*>(args.b) + t * args.b_member_elems;
  arr.b[t] = reinterpret_cast<const ElementA*>(b);
  arr.d[t] = static_cast<ElementD*>(args.d) + row0 * out_cols;
  arr.sa[t] = make_ld_stride<Arrays::StrideA>(red);
  arr.sb[t] = make_ld_stride<Arrays::StrideB>(ldb);
  arr.sd[t] = make_ld_stride<Arrays::StrideD>(out_cols);
  sc.sfa[t] = args.a_scale + red_blocks * args.rows.pad4[t];
  sc.sfb[t] = args.b_scale + t * args.b_scale_member_elems;
  sc.lsfa[t] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(int(m), int(out_cols), int(red), 1));
  sc.lsfb[t] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(int(m), int(out_cols), int(red), 1));
}

}  // namespace

cudaError_t fp8_block_grouped_gemm_1x128_128x128(const GroupedGemmArgs& args) {
  if (args.kind == GemmKind::kWgrad) return cudaErrorInvalidValue;
  if (args.num_groups <= 0) return cudaSuccess;
  SetupCarver carver{static_cast<char*>(args.setup)};
  Arrays arr = Arrays::carve(carver, args.num_groups);
  ScaleArrays sc{carver.take<const float*>(args.num_groups), carver.take<const float*>(args.num_groups),
                 carver.take<LayoutSFA>(args.num_groups), carver.take<LayoutSFB>(args.num_groups)};
  if (carver.used > args.setup_bytes) return cudaErrorInvalidValue;
  build_args<<<(args.num_groups + 127) / 128, 128, 0, args.stream>>>(args, arr, sc);
  typename Kernel::MainloopArguments mainloop{arr.a, arr.sa, arr.b, arr.sb, sc.sfa, sc.lsfa, sc.sfb, sc.lsfb};
  typename Kernel::EpilogueArguments epilogue{{}, nullptr, arr.sc, arr.d, arr.sd};
  epilogue.thread.alpha = 1.0f;
  epilogue.thread.beta = 0.0f;
  return run_grouped<Gemm>(args, arr.shape, mainloop, epilogue);
}

#else

cudaError_t fp8_block_grouped_gemm_1x128_128x128(const GroupedGemmArgs&) { return cudaErrorNotSupported; }

#endif

}  // namespace gemm
}  // namespace lpmoe
