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
#   stages3   3 pipeline stages;  noscale  no A-scale bulk copies
#   nomcast   cluster 2 without the B multicast (each CTA loads all of B)
#   skipA / skipB  one operand never loaded (confounded: stale shared memory
#             feeds the tensor cores zeros, which draw less power)
#   trace_noload_noepi  trace, no loads, no TMA-store epilogue
#   syncrel   the stage handed back with __syncwarp + lane 0's arrives
#   scalesfirst  the scale products consumed before the wgmma fence
#   overlap_epilogue  (diffs/) the next tile's first K-block issued before the
#             finished tile's epilogue (stop 35: slower at n192c2, spills)
#   trace     clock64() per tile of CTA 0's two math warpgroups (harness -DTRACE)
# The variants of the K loop with the stage index in a register (pingpong,
# alternate, twoacc, unroll*, incdesc; docs/fp8-gemm-kernel-notes.md, stops
# 32-33) went with that loop in stop 34; they are in git history (032f8c5).
import pathlib, shutil, sys
root = pathlib.Path(__file__).resolve().parents[2]
K = "fp8_gemm/kernel_1x128_128x128.cuh"
PROMO = "promote<BlockN, kSplit>(res, acc, s00, s01, s10, s11);"
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
# The math warps' tile loop starts after the full-barrier phase declaration.
MATH_START = "  uint32_t phase = 0;  // of the full barriers, flipped once per ring turn\n  for (int tile"
LOC = "    const TileCoord c = sched.locate(tile);\n    const int n0"
KEND = "    if constexpr (kEarlyScales) {\n      if (tile + tile_step"
EEND = "    }\n  }\n  if (lane == 0) cute::tma_store_wait<0>();"
TR = [(LOC, "    const long long tr0 = clock64();\n" + LOC),
      (KEND, "    const long long tr1 = clock64();\n" + KEND),
      (EEND, EEND.replace("    }\n  }\n", "    }\n    if (blockIdx.x == 0 && (threadIdx.x == 0 || threadIdx.x == 128) && tr_n < 200) { long long* t = g_trace + (threadIdx.x / 128) * 600 + 3 * tr_n; t[0] = tr0; t[1] = tr1; t[2] = clock64(); ++tr_n; }\n  }\n")),
      ("template <int BlockN, int Cluster, class Sched>\n__device__", "__device__ long long g_trace[1200];\ntemplate <int BlockN, int Cluster, class Sched>\n__device__"),
      (MATH_START, MATH_START.replace("\n  for (int tile", "\n  int tr_n = 0;\n  for (int tile"))]
patches["trace"] = TR
patches["trace_noload"] = TR + patches["noload"]
# syncrel: the stage handed back through release_stage (__syncwarp, lane 0
# arrives on each CTA) instead of the per-lane predicated arrive: what the
# memory model's order of the lanes' A-scale reads before the arrive costs.
REL = "        release_stage_lanes<Cluster>(&empty[s], lane);  // the wgmmas have read the stage\n"
patches["syncrel"] = [(REL, REL.replace("release_stage_lanes", "release_stage"))]
patches["syncrel_noload"] = patches["syncrel"] + patches["noload"]
# scalesfirst: the scale products consumed before the wgmma fence (an empty
# asm on each), so every lane's A-scale reads have returned before its
# wgmmas are issued: the other way to order them, at the price of the load
# latency before the first wgmma.
SCALES = "        const float s10 = sa[row_in_tile + 8] * sb0, s11 = sa[row_in_tile + 8] * sb1;\n"
patches["scalesfirst"] = [(SCALES, SCALES + "        float s00f = s00, s01f = s01, s10f = s10, s11f = s11;\n"
                           "        cute::warpgroup_fence_operand(s00f); cute::warpgroup_fence_operand(s01f);\n"
                           "        cute::warpgroup_fence_operand(s10f); cute::warpgroup_fence_operand(s11f);\n"),
                          ("        promote<BlockN, kSplit>(res, acc, s00, s01, s10, s11);\n",
                           "        promote<BlockN, kSplit>(res, acc, s00f, s01f, s10f, s11f);\n")]
patches["scalesfirst_noload"] = patches["scalesfirst"] + patches["noload"]
# noepi: no TMA-store epilogue (the strips are neither written nor stored):
# the per-tile cost of the epilogue, with the trace.
EPI = "      store_strip_tma<BlockN>(map_d, res, strip, lane, n0, c.row0 + warp_row0, p.n_cols);"
patches["trace_noload_noepi"] = TR + patches["noload"] + [(EPI, "      if (p.num_groups < 0) " + EPI.lstrip())]
# b4wait: the tile's B scales read before the full-barrier wait (DeepGEMM's
# order).  Stop 35 landed the variants stsm (the strip written with
# stmatrix) and r232 (the 40 / 232 register split); regs232 (r232 + b4wait)
# timed like r232.
BSC = "        const float sb0 = sb[kb], sb1 = sb[nkb + kb];\n"
WAITL = "        Barrier::wait(&full[s], phase);\n        // This tile's B scales"
patches["b4wait"] = [(BSC, ""), (WAITL, BSC + WAITL)]
patches["b4wait_noload"] = patches["b4wait"] + patches["noload"]
# Tile-boundary costs, compute-only: noepi_noload (no strip, no stores),
# nofetch_noload (cluster 2 without the next tile's B-scale fetch: stale
# scales, timing only), late_noload (cluster 2 fetching at the tile start).
patches["noepi_noload"] = patches["noload"] + [(EPI, "      if (p.num_groups < 0) " + EPI.lstrip())]
FETCH = "      if (tile + tile_step < total) fetch_b_scales(tile + tile_step);  // lands during the epilogue"
patches["nofetch_noload"] = patches["noload"] + [(FETCH, FETCH.replace("tile + tile_step < total", "tile + tile_step < total && p.num_groups < 0"))]
patches["late_noload"] = patches["noload"] + [("  constexpr bool kEarlyScales = Cluster == 2;", "  constexpr bool kEarlyScales = false;")]
# band8 / band32: the scheduler's bands of 128-row tiles (activations kept
# in L2 while the weights stream) at half / twice today's 16.
BAND = "H:constexpr int kBandRowTiles = 16;"
patches["band8"] = [(BAND, "constexpr int kBandRowTiles = 8;")]
patches["band32"] = [(BAND, "constexpr int kBandRowTiles = 32;")]
MW = "fp8_gemm/math_warpgroup.cuh"
H = "fp8_gemm/block_scaled.h"
EXP = "TxBarrier::arrive_and_expect_tx(&full[pos.stage], L::kStageBytes + sa_bytes);"
ALOAD = "tma_load_2d(&tma_a, &full[pos.stage], st, kb * kBlockK, a_row);"
SBL = "uint8_t* sb = st + L::kABytes + rank * kBRows * kRowBytes;"
MC = "tma_load_3d_multicast(&tma_b, &full[pos.stage], (1u << Cluster) - 1u, sb, kb * kBlockK, b_row, c.group);"
patches["stages3"] = [("H:static constexpr int kStages = kStagesFit < 4 ? kStagesFit : 4;", "static constexpr int kStages = 3;")]
patches["noscale"] = [(EXP, EXP.replace(" + sa_bytes", "")), ("if (sa_bytes != 0) {", "if (sa_bytes != 0 && p.num_groups < 0) {")]
patches["skipB"] = [(EXP, EXP.replace("L::kStageBytes", "L::kABytes")), (SBL, SBL + " if (p.num_groups > 0) { pos.next(); continue; }")]
patches["skipA"] = [(EXP, EXP.replace("L::kStageBytes", "L::kBBytes")), (ALOAD, "if (p.num_groups < 0) " + ALOAD)]
patches["nomcast"] = [(MC, "tma_load_3d(&tma_b, &full[pos.stage], st + L::kABytes, kb * kBlockK, c.n_block * BlockN, c.group); tma_load_3d(&tma_b, &full[pos.stage], st + L::kABytes + kBRows * kRowBytes, kb * kBlockK, c.n_block * BlockN + kBRows, c.group);")]
# prev_<name>: the same patch on prev_csrc/ (build_run.sh), for a before /
# after comparison of a kernel change under one ablation.
prev = pathlib.Path(__file__).parent / "prev_csrc"
sources = {name: root / "csrc" for name in patches}
if prev.is_dir():
    for name in ("noload",):
        patches["prev_" + name] = patches[name]
        sources["prev_" + name] = prev
for name, subs in patches.items():
    dst = pathlib.Path(__file__).parent / "variants" / name / "csrc"
    if dst.exists(): shutil.rmtree(dst)
    shutil.copytree(sources[name], dst)
    for old, new in subs:
        f = dst / (H if old.startswith("H:") else MW if old.startswith("M:") else K)
        old = old[2:] if old[:2] in ("H:", "M:") else old
        s = f.read_text()
        if s.count(old) != 1:
            print("skip", name); shutil.rmtree(dst.parent); break
        f.write_text(s.replace(old, new))
# Whole-kernel experiments kept as diffs against csrc/ (diffs/<name>.diff,
# `git diff -- csrc` of the experiment): variant <name> and <name>_noload.
import subprocess
for diff in sorted((pathlib.Path(__file__).parent / "diffs").glob("*.diff")):
    for name, extra in ((diff.stem, []), (diff.stem + "_noload", patches["noload"])):
        dst = pathlib.Path(__file__).parent / "variants" / name
        if dst.exists(): shutil.rmtree(dst)
        shutil.copytree(root / "csrc", dst / "csrc")
        # --fuzz=0: a diff that no longer matches exactly is skipped, never applied loosely.
        ok = shutil.which("patch") is not None and subprocess.run(
            ["patch", "-s", "--fuzz=0", "-p1", "-d", str(dst), "-i", str(diff)], capture_output=True).returncode == 0
        for old, new in extra:
            f = dst / "csrc" / K
            s = f.read_text()
            ok = ok and s.count(old) == 1
            if ok: f.write_text(s.replace(old, new))
        if not ok:
            print("skip", name); shutil.rmtree(dst); continue
        patches[name] = []
print(" ".join(patches))
