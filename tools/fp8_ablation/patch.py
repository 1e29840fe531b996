# Ablation variants of the fprop/dgrad kernel (tools/fp8_ablation): writes
# patched copies of csrc/ under variants/<name>/csrc.  Each patch is an exact
# text substitution in kernel_1x128_128x128.cuh (or block_scaled.h, "H:"); a
# variant whose text no longer matches the source is skipped with a message,
# never built wrong.  Variants:
#   base      the source as is
#   nopromo   promotion only on a tile's last K-block (cost of the FFMA promotion)
#   nostore   no global stores in the masked epilogue path
#   noload    the producer loads only the first ring of stages, then arrives
#             without data (compute-only time; the data stay random)
#   stages4   4 pipeline stages;  noscale  no A-scale bulk copies
#   nomcast   cluster 2 without the B multicast (each CTA loads all of B)
#   skipA / skipB  one operand never loaded (confounded: stale shared memory
#             feeds the tensor cores zeros, which draw less power)
#   pingpong  math warpgroups take turns issuing their wgmmas (named barriers)
#   alternate the turn passes when a warpgroup's wgmmas have completed
#   twoacc    next K-block's wgmmas in flight during the promotion (BlockN <= 128)
#   unroll    K loop over ring turns, stage index known at compile time
#   unroll2   the same, with the weight-scale split chosen once per tile
#   unroll3   unroll2 with per-stage addresses kept from being hoisted
#   unroll4   unroll2 with the scratch accumulator pinned across stages
#   incdesc   stage descriptors as stage-0 descriptors plus a multiple
#   trace     clock64() per tile of CTA 0's two math warpgroups (harness -DTRACE)
import pathlib, shutil, sys
root = pathlib.Path(__file__).resolve().parents[2]
K = "fp8_gemm/kernel_1x128_128x128.cuh"
PROMO = "promote_dispatch<BlockN>(split, res, acc, sa0 * sb0, sa0 * sb1, sa1 * sb0, sa1 * sb1);"
STORE = "if (row_ok && col < p.n_cols) *reinterpret_cast<uint4*>(drow + col) = piece;"
PROD = "          TxBarrier::arrive_and_expect_tx(&full[pos.stage], L::kStageBytes + sa_bytes);"
PRODPOS = "      RingPos<kStages> pos;\n      for (int tile"
patches = {
    "nopromo": [(PROMO, "if (kb + 1 == nkb) " + PROMO)],
    "nostore": [(STORE, STORE.replace("col < p.n_cols", "col < p.n_cols && p.num_groups < 0"))],
    "noload": [(PRODPOS, "      RingPos<kStages> pos;\n      int ablate_n = 0;\n      for (int tile"),
               (PROD, "          if (ablate_n++ >= kStages) { Barrier::arrive(&full[pos.stage]); pos.next(); continue; }\n" + PROD)],
}
patches["noload_nopromo"] = patches["noload"] + patches["nopromo"]
patches["nopromo_nostore"] = patches["nopromo"] + patches["nostore"]
patches["base"] = []
LOC = "    const TileCoord c = sched.locate(tile);\n    const int n0"
KEND = "    if constexpr (kEarlyScales) {\n      if (tile + tile_step"
EEND = "    }\n  }\n  if (lane == 0) cute::tma_store_wait<0>();"
TR = [(LOC, "    const long long tr0 = clock64();\n" + LOC),
      (KEND, "    const long long tr1 = clock64();\n" + KEND),
      (EEND, EEND.replace("    }\n  }\n", "    }\n    if (blockIdx.x == 0 && (threadIdx.x == 0 || threadIdx.x == 128) && tr_n < 200) { long long* t = g_trace + (threadIdx.x / 128) * 600 + 3 * tr_n; t[0] = tr0; t[1] = tr1; t[2] = clock64(); ++tr_n; }\n  }\n")),
      ("template <int BlockN, int Cluster, class Sched>\n__device__", "__device__ long long g_trace[1200];\ntemplate <int BlockN, int Cluster, class Sched>\n__device__"),
      ("  RingPos<kStages> pos;\n  for (int tile", "  RingPos<kStages> pos;\n  int tr_n = 0;\n  for (int tile")]
patches["trace"] = TR
patches["trace_noload"] = TR + patches["noload"]
# pingpong: the two math warpgroups take turns issuing a K-block's wgmmas
# (named barriers 3 + wg), so the tensor pipe runs one warpgroup's K-block
# while the other promotes, instead of both promoting at once.
WGMMA = "      kblock_wgmma<BlockN>(da, db, acc);"
TURN = ("      cutlass::arch::NamedBarrier::sync(256, 3 + wg);\n"
        "      for (int i = 0; i < BlockN / 2; ++i) cute::warpgroup_fence_operand(acc[i]);\n"
        "      cute::warpgroup_arrive();\n"
        "      for (int ks = 0; ks < kBlockK / kWgmmaK; ++ks) wgmma_fp8<BlockN>(advance_k(da, ks), advance_k(db, ks), acc, ks > 0);\n"
        "      cute::warpgroup_commit_batch();\n"
        "      cutlass::arch::NamedBarrier::arrive(256, 3 + (wg ^ 1));\n"
        "      for (int i = 0; i < BlockN / 2; ++i) cute::warpgroup_fence_operand(acc[i]);\n"
        "      cute::warpgroup_wait<0>();\n"
        "      for (int i = 0; i < BlockN / 2; ++i) cute::warpgroup_fence_operand(acc[i]);")
MSTART = "  RingPos<kStages> pos;\n  for (int tile"
MEND = "  if (lane == 0) cute::tma_store_wait<0>();  // the strips are read"
patches["pingpong"] = [(WGMMA, TURN),
                       (MSTART, "  if (wg == 1) cutlass::arch::NamedBarrier::arrive(256, 3);\n" + MSTART),
                       (MEND, "  if (wg == 0) cutlass::arch::NamedBarrier::sync(256, 3);\n" + MEND)]
patches["pingpong_noload"] = patches["pingpong"] + patches["noload"]
# alternate: as pingpong, but the turn passes only once this warpgroup's
# wgmmas have completed, so the tensor pipe never holds both warpgroups'
# K-blocks at once (pingpong hands over right after issue: both still queue
# together, execute interleaved and finish together).
ALT = TURN.replace("      cutlass::arch::NamedBarrier::arrive(256, 3 + (wg ^ 1));\n", "") + \
    "\n      cutlass::arch::NamedBarrier::arrive(256, 3 + (wg ^ 1));"
patches["alternate"] = [(WGMMA, ALT)] + patches["pingpong"][1:]
patches["alternate_noload"] = patches["alternate"] + patches["noload"]
# twoacc: each warpgroup keeps its next K-block's wgmmas in flight while it
# promotes the current one (two scratch accumulators; only BlockN <= 128
# fits the registers, wider tiles keep the base loop).
KLOOP_OLD = """    for (int kb = 0; kb < nkb; ++kb) {
      Barrier::wait(&full[pos.stage], pos.phase);
      const uint8_t* st = smem + pos.stage * L::kStageBytes;
      // Scales from shared memory, read before the wgmma fence (which would
      // otherwise wait on the loads).  Rows past the group read stale values
      // and are dropped by the epilogue.
      const float* sa = reinterpret_cast<const float*>(smem + L::kAScaleOffset) + pos.stage * kBlockM;
      const float sa0 = sa[row_in_tile], sa1 = sa[row_in_tile + 8];
      const float sb0 = sb[kb], sb1 = sb[nkb + kb];
      const uint64_t da = sw128_kmajor_desc(st + wg * 64 * kRowBytes);
      const uint64_t db = sw128_kmajor_desc(st + L::kABytes);
      kblock_wgmma<BlockN>(da, db, acc);
      // This warp's wgmmas have read the stage: hand it back to the producer.
      release_stage<Cluster>(&empty[pos.stage], lane);
      promote_dispatch<BlockN>(split, res, acc, sa0 * sb0, sa0 * sb1, sa1 * sb0, sa1 * sb1);
      pos.next();
    }
"""
KLOOP_NEW = """    if constexpr (BlockN <= 128) {
      float acc2[BlockN / 2];
      float a0[2], a1[2];  // A scales of the batch in acc (0) / acc2 (1)
      auto issue = [&](float (&dst)[BlockN / 2], const RingPos<kStages>& at, float& s0, float& s1) {
        Barrier::wait(&full[at.stage], at.phase);
        const uint8_t* st = smem + at.stage * L::kStageBytes;
        const float* sa = reinterpret_cast<const float*>(smem + L::kAScaleOffset) + at.stage * kBlockM;
        s0 = sa[row_in_tile]; s1 = sa[row_in_tile + 8];
        const uint64_t da = sw128_kmajor_desc(st + wg * 64 * kRowBytes);
        const uint64_t db = sw128_kmajor_desc(st + L::kABytes);
#pragma unroll
        for (int i = 0; i < BlockN / 2; ++i) cute::warpgroup_fence_operand(dst[i]);
        cute::warpgroup_arrive();
#pragma unroll
        for (int ks = 0; ks < kBlockK / kWgmmaK; ++ks) wgmma_fp8<BlockN>(advance_k(da, ks), advance_k(db, ks), dst, ks > 0);
        cute::warpgroup_commit_batch();
#pragma unroll
        for (int i = 0; i < BlockN / 2; ++i) cute::warpgroup_fence_operand(dst[i]);
      };
      // nkb even (every harness shape): pairs of K-blocks, acc then acc2
      auto retire = [&](float (&src)[BlockN / 2], int kb, float s0, float s1) {
#pragma unroll
        for (int i = 0; i < BlockN / 2; ++i) cute::warpgroup_fence_operand(src[i]);
        release_stage<Cluster>(&empty[pos.stage], lane);
        const float sb0 = sb[kb], sb1 = sb[nkb + kb];
        promote_dispatch<BlockN>(split, res, src, s0 * sb0, s0 * sb1, s1 * sb0, s1 * sb1);
        pos.next();
      };
      RingPos<kStages> nx = pos;
      issue(acc, nx, a0[0], a1[0]); nx.next();
      auto pair = [&](int kb) {
        issue(acc2, nx, a0[1], a1[1]); nx.next();
        cute::warpgroup_wait<1>();
        retire(acc, kb, a0[0], a1[0]);
        issue(acc, nx, a0[0], a1[0]); nx.next();
        cute::warpgroup_wait<1>();
        retire(acc2, kb + 1, a0[1], a1[1]);
      };
      // Fully unrolled for the harness's K (ptxas serializes a batch in
      // flight across a loop back edge); other K: trap (experiment only).
      if (nkb == 56) {
#pragma unroll
        for (int kb = 0; kb + 2 < 56; kb += 2) pair(kb);
      } else if (nkb == 16) {
#pragma unroll
        for (int kb = 0; kb + 2 < 16; kb += 2) pair(kb);
      } else {
        __trap();
      }
      issue(acc2, nx, a0[1], a1[1]);
      cute::warpgroup_wait<1>();
      retire(acc, nkb - 2, a0[0], a1[0]);
      cute::warpgroup_wait<0>();
      retire(acc2, nkb - 1, a0[1], a1[1]);
    } else {
""" + KLOOP_OLD.replace("\n    ", "\n      ").replace("    for (int kb", "      for (int kb", 1) + "    }\n"
patches["twoacc"] = [(KLOOP_OLD, KLOOP_NEW)]
# unroll: the K loop over ring turns with the stage a compile-time index, as
# DeepGEMM's (constant stage offsets for the barriers, the A scales and the
# descriptors; the phase flips once per turn).  With nkb a multiple of the
# stage count the ring is at stage 0 at every tile start, so the producer is
# unchanged; other nkb trap (experiment only).
KLOOP_UNROLL = """    if (nkb % kStages != 0 || pos.stage != 0) __trap();
    uint32_t phase = pos.phase;
    for (int kt = 0; kt < nkb; kt += kStages, phase ^= 1u) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) {
        const int kb = kt + s;
        Barrier::wait(&full[s], phase);
        const uint8_t* st = smem + s * L::kStageBytes;
        const float* sa = reinterpret_cast<const float*>(smem + L::kAScaleOffset) + s * kBlockM;
        const float sa0 = sa[row_in_tile], sa1 = sa[row_in_tile + 8];
        const float sb0 = sb[kb], sb1 = sb[nkb + kb];
        const uint64_t da = sw128_kmajor_desc(st + wg * 64 * kRowBytes);
        const uint64_t db = sw128_kmajor_desc(st + L::kABytes);
        kblock_wgmma<BlockN>(da, db, acc);
        release_stage<Cluster>(&empty[s], lane);
        promote_dispatch<BlockN>(split, res, acc, sa0 * sb0, sa0 * sb1, sa1 * sb0, sa1 * sb1);
        asm volatile("" ::: "memory");  // keep the compiler from hoisting the next stage's work
      }
    }
    pos.phase = phase;
"""
patches["unroll"] = [(KLOOP_OLD, KLOOP_UNROLL)]
# unroll2: as unroll, with the weight-scale split chosen once per tile (one
# K loop per split value) instead of a branch per K-block.
SPLIT_DISPATCH = """template <int BlockN, int Split = 128, class F>
__device__ __forceinline__ void split_dispatch(int split, F&& f) {
  constexpr int kStep = BlockScaledLayout<BlockN>::gcd128(BlockN);
  if constexpr (Split - kStep <= 0) {
    f(std::integral_constant<int, Split>{});
  } else {
    if (split == Split) f(std::integral_constant<int, Split>{});
    else split_dispatch<BlockN, Split - kStep>(split, f);
  }
}

// The two math warpgroups: wgmma + promotion per K-block, bf16 epilogue."""
UNROLL_PROMOTE = "        promote_dispatch<BlockN>(split, res, acc, sa0 * sb0, sa0 * sb1, sa1 * sb0, sa1 * sb1);\n"
UNROLL_FENCE = "        asm volatile(\"\" ::: \"memory\");  // keep the compiler from hoisting the next stage's work\n"
_TRAP, _TURNS = KLOOP_UNROLL.split("\n", 1)
KLOOP_UNROLL2 = (_TRAP + "\n    split_dispatch<BlockN>(split, [&](auto split_tag) {\n"
                 "      constexpr int kSplit = decltype(split_tag)::value;\n"
                 + "".join(("" if line.startswith("#") else "  ") + line + "\n" for line in _TURNS.replace(UNROLL_FENCE, "").replace(
                     UNROLL_PROMOTE, "        promote<BlockN, kSplit>(res, acc, sa0 * sb0, sa0 * sb1, sa1 * sb0, "
                     "sa1 * sb1);\n").splitlines())
                 + "    });\n")
patches["unroll2"] = [(KLOOP_OLD, KLOOP_UNROLL2), ("// The two math warpgroups: wgmma + promotion per K-block, bf16 epilogue.", SPLIT_DISPATCH)]
patches["unroll2_noload"] = patches["unroll2"] + patches["noload"]
# unroll3: unroll2 with the stage addresses laundered through an empty asm
# per stage, so the compiler cannot hoist every stage's descriptors and
# barrier addresses out of the turn loop (what made unroll spill).
KLOOP_UNROLL3 = KLOOP_UNROLL2.replace(
    """          Barrier::wait(&full[s], phase);
          const uint8_t* st = smem + s * L::kStageBytes;
          const float* sa = reinterpret_cast<const float*>(smem + L::kAScaleOffset) + s * kBlockM;""",
    """          uint8_t* sm = smem;
          uint64_t* fb = full;
          uint64_t* eb = empty;
          asm volatile("" : "+l"(sm), "+l"(fb), "+l"(eb));
          Barrier::wait(&fb[s], phase);
          const uint8_t* st = sm + s * L::kStageBytes;
          const float* sa = reinterpret_cast<const float*>(sm + L::kAScaleOffset) + s * kBlockM;""").replace(
    "          release_stage<Cluster>(&empty[s], lane);", "          release_stage<Cluster>(&eb[s], lane);")
assert KLOOP_UNROLL3 != KLOOP_UNROLL2
patches["unroll3"] = [(KLOOP_OLD, KLOOP_UNROLL3), patches["unroll2"][1]]
# unroll4: unroll2 with the scratch accumulator kept live from one stage to
# the next (an empty asm that reads and writes it), so every unrolled stage
# uses the same registers for it.
KLOOP_UNROLL4 = KLOOP_UNROLL2.replace(
    "          promote<BlockN, kSplit>(res, acc, sa0 * sb0, sa0 * sb1, sa1 * sb0, sa1 * sb1);\n",
    "          promote<BlockN, kSplit>(res, acc, sa0 * sb0, sa0 * sb1, sa1 * sb0, sa1 * sb1);\n"
    "#pragma unroll\n          for (int i = 0; i < BlockN / 2; ++i) cute::warpgroup_fence_operand(acc[i]);\n")
assert KLOOP_UNROLL4 != KLOOP_UNROLL2
patches["unroll4"] = [(KLOOP_OLD, KLOOP_UNROLL4), patches["unroll2"][1]]
patches["unroll4_noload"] = patches["unroll4"] + patches["noload"]
# incdesc: the runtime K loop with each stage's descriptors as stage-0
# descriptors plus stage x (stage bytes >> 4) (the 14-bit address field
# cannot carry: shared memory < 256 KB), instead of rebuilt from the address
# every K-block.
INC_OLD = """      const uint64_t da = sw128_kmajor_desc(st + wg * 64 * kRowBytes);
      const uint64_t db = sw128_kmajor_desc(st + L::kABytes);
      kblock_wgmma<BlockN>(da, db, acc);
      // This warp's"""
INC_NEW = """      const uint64_t step = static_cast<uint64_t>(pos.stage) * (L::kStageBytes >> 4);
      const uint64_t da = da0 + step;
      const uint64_t db = db0 + step;
      kblock_wgmma<BlockN>(da, db, acc);
      // This warp's"""
INC_DECL = ("  RingPos<kStages> pos;\n  for (int tile",
            "  const uint64_t da0 = sw128_kmajor_desc(smem + wg * 64 * kRowBytes);\n"
            "  const uint64_t db0 = sw128_kmajor_desc(smem + L::kABytes);\n"
            "  RingPos<kStages> pos;\n  for (int tile")
patches["incdesc"] = [(INC_OLD, INC_NEW), INC_DECL]
patches["incdesc_noload"] = patches["incdesc"] + patches["noload"]
patches["unroll3_noload"] = patches["unroll3"] + patches["noload"]
# unroll2r: unroll2 with DeepGEMM's register split (producer 40, math 232)
MW = "fp8_gemm/math_warpgroup.cuh"
patches["unroll2r"] = patches["unroll2"] + [("M:constexpr int kProducerRegs = 56;", "constexpr int kProducerRegs = 40;"),
                                            ("M:constexpr int kMathRegs = 224;", "constexpr int kMathRegs = 232;")]
patches["unroll2r_noload"] = patches["unroll2r"] + patches["noload"]
patches["unroll2s"] = patches["unroll2"] + [("M:constexpr int kProducerRegs = 56;", "constexpr int kProducerRegs = 24;"),
                                            ("M:constexpr int kMathRegs = 224;", "constexpr int kMathRegs = 240;")]
patches["unroll2s_noload"] = patches["unroll2s"] + patches["noload"]
patches["unroll_noload"] = patches["unroll"] + patches["noload"]
patches["twoacc_noload"] = patches["twoacc"] + patches["noload"]
H = "fp8_gemm/block_scaled.h"
EXP = "TxBarrier::arrive_and_expect_tx(&full[pos.stage], L::kStageBytes + sa_bytes);"
ALOAD = "tma_load_2d(&tma_a, &full[pos.stage], st, kb * kBlockK, a_row);"
SBL = "uint8_t* sb = st + L::kABytes + rank * kBRows * kRowBytes;"
MC = "tma_load_3d_multicast(&tma_b, &full[pos.stage], (1u << Cluster) - 1u, sb, kb * kBlockK, b_row, c.group);"
patches["stages4"] = [("H:(kSmemLimit - 1024 - kBScaleBytes - kEpilogueBytes - 8192) / (kStageBytes + kAScaleStageBytes);", "4;")]
patches["noscale"] = [(EXP, EXP.replace(" + sa_bytes", "")), ("if (sa_bytes != 0) {", "if (sa_bytes != 0 && p.num_groups < 0) {")]
patches["skipB"] = [(EXP, EXP.replace("L::kStageBytes", "L::kABytes")), (SBL, SBL + " if (p.num_groups > 0) { pos.next(); continue; }")]
patches["skipA"] = [(EXP, EXP.replace("L::kStageBytes", "L::kBBytes")), (ALOAD, "if (p.num_groups < 0) " + ALOAD)]
patches["nomcast"] = [(MC, "tma_load_3d(&tma_b, &full[pos.stage], st + L::kABytes, kb * kBlockK, c.n_block * BlockN, c.group); tma_load_3d(&tma_b, &full[pos.stage], st + L::kABytes + kBRows * kRowBytes, kb * kBlockK, c.n_block * BlockN + kBRows, c.group);")]
for name, subs in patches.items():
    dst = pathlib.Path(__file__).parent / "variants" / name / "csrc"
    if dst.exists(): shutil.rmtree(dst)
    shutil.copytree(root / "csrc", dst)
    for old, new in subs:
        f = dst / (H if old.startswith("H:") else MW if old.startswith("M:") else K)
        old = old[2:] if old[:2] in ("H:", "M:") else old
        s = f.read_text()
        if s.count(old) != 1:
            print("skip", name); shutil.rmtree(dst.parent); break
        f.write_text(s.replace(old, new))
print(" ".join(patches))
