# Patched copies of the git-ignored .peers/DeepGEMM for the same ablations
# (noload, nopromo) under tools/fp8_ablation/dg/ (git-ignored, never committed).
import pathlib, shutil
root = pathlib.Path(__file__).resolve().parents[2]
src = root / ".peers" / "DeepGEMM"
F = "deep_gemm/include/deep_gemm/fp8_gemm.cuh"
LOAD = "                        auto& full_barrier = *full_barriers[s];\n"
PROMO = "                    	for (uint32_t i = 0; i < WGMMA::kNumAccum / 4; ++ i) {\n"
NOLOAD = (LOAD, LOAD + "                        if (scheduler.current_iter * kNumIterations + k_iter >= 1) { full_barrier.arrive(); continue; }\n")
NOPROMO = (PROMO, "                    	if (k_iter + 1 == kNumIterations && s == 0)\n" + PROMO)
variants = {"dgbase": [], "dgnoload": [NOLOAD], "dgnopromo": [NOPROMO], "dgnoload_nopromo": [NOLOAD, NOPROMO]}
# dgtrace*: clock64() per tile of CTA 0's two math warpgroups, printed at the
# kernel's end in the harness's trace format (main loop, epilogue, gap).
TR = [("        const auto r_0 = warp_idx * 16 + lane_idx / 4, r_1 = r_0 + 8;\n",
       "        const auto r_0 = warp_idx * 16 + lane_idx / 4, r_1 = r_0 + 8;\n"
       "        long long trk = 0, tre = 0, trg = 0, trl = -1; int trn = 0;\n"),
      ("            // Decide the number of scales B to load\n",
       "            const long long tr0 = clock64();\n            // Decide the number of scales B to load\n"),
      ("            // TMA checks\n", "            const long long tr1 = clock64();\n            // TMA checks\n"),
      ("            __syncwarp();\n        }\n    }\n#else",
       "            __syncwarp();\n            const long long tr2 = clock64();\n"
       "            trk += tr1 - tr0; tre += tr2 - tr1; if (trl >= 0) trg += tr0 - trl; trl = tr2; ++trn;\n        }\n"
       "        if (blockIdx.x == 0 and (threadIdx.x == 0 or threadIdx.x == 128) and trn > 1)\n"
       "            printf(\"dgtrace wg%d tiles %d per tile: mainloop %lld (per kblock %.0f) epilogue %lld gap %lld\\n\",\n"
       "                   int(threadIdx.x / 128), trn, trk / trn, double(trk) / trn / (SHAPE_K / BLOCK_K), tre / trn, trg / (trn - 1));\n"
       "    }\n#else")]
variants["dgtrace"] = TR
variants["dgtrace_noload"] = [NOLOAD] + TR
for name, subs in variants.items():
    dst = pathlib.Path(__file__).parent / "dg" / name
    if dst.exists(): shutil.rmtree(dst)
    shutil.copytree(src, dst)
    f = dst / F
    s = f.read_text()
    for old, new in subs:
        assert s.count(old) == 1, (name, old[:40])
        s = s.replace(old, new)
    f.write_text(s)
print(" ".join(variants))
