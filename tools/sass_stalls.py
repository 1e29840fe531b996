"""Summarise ncu's per-SASS-instruction table (tools/profile_fp8_gemm.sh with
FP8_SOURCE=1 writes sass_<config>.csv[.gz]): where the warps' stall samples and
executed instructions go, by instruction kind, and the top sampled lines.

    python tools/sass_stalls.py sass_192_1.csv.gz sass_deepgemm.csv.gz
"""
from __future__ import annotations

import collections
import csv
import gzip
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def kind(op: str, prev: str) -> str:
    if "DEPBAR" in op:
        return "wgmma wait (DEPBAR)"
    if op.startswith(("QGMMA", "HGMMA", "WARPGROUP")):
        return "wgmma issue/arrive"
    if op.startswith("SYNCS") or (op == "BRA" and "SYNCS" in prev):
        return "mbarrier wait/arrive"
    if op.startswith(("FFMA", "FMUL")):
        return "promotion (FFMA/FMUL)"
    if op.startswith(("STG", "STS", "STSM", "UTMA", "UBLKCP")):
        return "stores / TMA"
    if op.startswith(("LDG", "LDS", "LDC", "LD")):
        return "loads"
    if op == "BRA":
        return "branch"
    return "other"


def summarise(path: str, top: int = 12) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    header, data = rows[1], rows[2:]
    col = {h: i for i, h in enumerate(header)}
    stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples, executed, reasons = collections.Counter(), collections.Counter(), collections.Counter()
    prev = ""
    for r in data:
        src = r[1].strip()
        op = re.sub(r"^@!?U?P\w+\s+", "", src).split(" ")[0]
        k = kind(op, prev)
        samples[k] += int(r[col[SAMPLES]] or 0)
        executed[k] += int(r[col[EXECUTED]] or 0)
        for h in stall_cols:
            reasons[h[6:]] += int(r[col[h]] or 0)
        prev = src
    s, e = sum(samples.values()) or 1, sum(executed.values()) or 1
    print(f"== {path}: {s} samples, {e / 1e6:.1f} M warp instructions")
    print("   stall reasons: " + ", ".join(f"{k} {100 * v / s:.1f}%" for k, v in reasons.most_common(8)))
    for k, v in samples.most_common():
        print(f"   {k:24s} {100 * v / s:5.1f}% of samples  {100 * executed[k] / e:5.1f}% of instructions")
    print("   top lines:")
    for r in sorted(data, key=lambda r: -int(r[col[SAMPLES]] or 0))[:top]:
        print(f"   {100 * int(r[col[SAMPLES]]) / s:5.1f}%  {r[1].strip()[:70]}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        summarise(p)
