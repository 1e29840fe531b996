"""Short smoke runs of the examples (CI covers them on the CPU)."""
import importlib.util

import pytest
import torch

import lpmoe

from conftest import load_example as _load


def test_train_moe_lm_smoke(tmp_path):
    """BF16 and FP8 runs of the MoE language model from one seed on the
    standard library's sources: both learn (loss falls from ln 256), stay
    close to each other, and the plot is written."""
    lm = _load("train_moe_lm")
    png = tmp_path / "loss.png"
    hists = lm.main(["--steps", "40", "--batch", "4", "--seq", "64", "--layers", "1", "--d-model", "64",
                     "--heads", "2", "--ffn", "128", "--experts", "4", "--warmup", "5", "--lr", "3e-3",
                     "--eval-every", "20", "--eval-batches", "2", "--data-mb", "1", "--device", "cpu",
                     "--plot", str(png)])
    assert set(hists) == {"bf16", "fp8"}
    for h in hists.values():
        assert h["val"][-1] < 0.8 * 5.545  # ln(256): a uniform guess
    assert abs(hists["fp8"]["val"][-1] / hists["bf16"]["val"][-1] - 1) < 0.05
    if importlib.util.find_spec("matplotlib") is not None:  # a requirement; the GPU machine may lack it
        assert png.stat().st_size > 10_000
    else:
        assert not png.exists()


def test_train_moe_lm_fp32_params_under_autocast(tmp_path):
    """--params fp32: fp32 parameters trained in place under
    torch.autocast(bfloat16) with a plain AdamW; BF16 and FP8 both learn
    and stay close, and the experts' parameters stay fp32."""
    lm = _load("train_moe_lm")
    args = ["--steps", "30", "--batch", "4", "--seq", "64", "--layers", "1", "--d-model", "64", "--heads", "2",
            "--ffn", "128", "--experts", "4", "--warmup", "5", "--lr", "3e-3", "--eval-every", "15",
            "--eval-batches", "2", "--data-mb", "1", "--device", "cpu", "--plot", "", "--params", "fp32"]
    hists = lm.main(args)
    for h in hists.values():
        assert h["val"][-1] < 0.8 * 5.545
    assert abs(hists["fp8"]["val"][-1] / hists["bf16"]["val"][-1] - 1) < 0.05
    model = lm.MoELM(lm.parse_args(args), torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("params", ["fp32", "bf16"])
def test_train_moe_lm_lpmoe_optimizer(tmp_path, params):
    """--optimizer lpmoe: lpmoe.optim.AdamW writes the experts' FP8 weights
    (its fused path counted, two layers per block per step) and trains as
    torch's AdamW does (on fp32 masters for bf16 parameters), up to
    AdamW's rounding order."""
    lm = _load("train_moe_lm")
    args = ["--steps", "12", "--batch", "2", "--seq", "32", "--layers", "1", "--d-model", "64", "--heads", "2",
            "--ffn", "128", "--experts", "4", "--warmup", "2", "--lr", "3e-3", "--eval-every", "12",
            "--eval-batches", "1", "--data-mb", "1", "--device", "cpu", "--plot", "", "--params", params,
            "--recipes", "fp8"]
    before = lpmoe.optim.stats()["fused"]
    fused = lm.main(args + ["--optimizer", "lpmoe"])["fp8"]["val"][-1]
    assert lpmoe.optim.stats()["fused"] - before == 2 * 12
    plain = lm.main(args)["fp8"]["val"][-1]
    assert abs(fused / plain - 1) < 0.01


def test_train_moe_lm_pools_seeds_from_processes(tmp_path, capsys):
    """Seeds trained by separate invocations (--json) pool into one summary
    with the per-seed gaps and their mean; the pooled histories are the
    written ones."""
    lm = _load("train_moe_lm")
    tiny = ["--steps", "6", "--batch", "2", "--seq", "32", "--layers", "1", "--d-model", "32", "--heads", "2",
            "--ffn", "32", "--experts", "2", "--eval-every", "3", "--eval-batches", "1", "--data-mb", "0.5",
            "--device", "cpu", "--plot", ""]
    runs = {}
    for seed in (0, 1):
        runs[seed] = lm.main(tiny + ["--seeds", str(seed), "--json", str(tmp_path / f"s{seed}.json")])
    capsys.readouterr()
    pooled = lm.main(["--pool", str(tmp_path / "s0.json"), str(tmp_path / "s1.json"), "--plot", ""])
    assert set(pooled) == {"bf16 s0", "fp8 s0", "bf16 s1", "fp8 s1"}
    assert pooled["fp8 s1"]["val"] == runs[1]["fp8"]["val"]
    out = capsys.readouterr().out
    assert "fp8 vs bf16 over 2 seeds: mean" in out and "bf16 across seeds" in out
    # one seed's recipes from separate processes pool too (the bf16-repeat use)
    lm.main(tiny + ["--seeds", "0", "--recipes", "bf16-repeat", "--json", str(tmp_path / "r0.json")])
    capsys.readouterr()
    both = lm.main(["--pool", str(tmp_path / "s0.json"), str(tmp_path / "r0.json"), "--plot", ""])
    # (on the CPU a repeated run is bitwise the same: a gap of exactly 0)
    assert both["bf16-repeat s0"]["val"] == both["bf16 s0"]["val"]
    assert "bf16-repeat vs bf16 final val loss: +0.00 %" in capsys.readouterr().out
    # a run given twice, or runs of another setup, are refused
    with pytest.raises(ValueError, match="repeats run"):
        lm.main(["--pool", str(tmp_path / "s0.json"), str(tmp_path / "s0.json"), "--plot", ""])
    lm.main(tiny[:1] + ["7"] + tiny[2:] + ["--seeds", "2", "--json", str(tmp_path / "long.json")])
    with pytest.raises(ValueError, match="other arguments.*steps"):
        lm.main(["--pool", str(tmp_path / "s0.json"), str(tmp_path / "long.json"), "--plot", ""])


def test_moe_layer_example_learns_cpu():
    ex = _load("moe_layer")
    losses = ex.main(["--device", "cpu", "--tokens", "256", "--hidden", "64", "--ffn", "32", "--experts", "4",
                      "--top-k", "2", "--steps", "25"])
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5])
