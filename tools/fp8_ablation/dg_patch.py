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
