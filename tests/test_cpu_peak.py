"""`% peak` in pipeline bench (pipeline/evaluation/cpu_peak.py): the multiply-adds counted from the shape are the
ones PyTorch's FLOP counter sees the model do, the instruction-set table and the clock parse as documented, and
every CPU row of a bench carries its share of the peak measured on this machine."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_cli
from torch.utils.flop_counter import FlopCounterMode

from model.config import preset
from model.transformer import build_model
from pipeline.evaluation import cpu_peak


def test_instruction_sets_and_clock():
    assert cpu_peak.isa({"avx2", "fma"})[1:] == (64, 16)
    assert cpu_peak.isa({"avx2", "avx_vnni"})[0].startswith("AVX-VNNI")
    assert cpu_peak.isa({"avx2", "avx512f", "avx512_vnni"}) == ("AVX-512 VNNI", 128, 32)
    assert cpu_peak.isa({"neon"})[1:] == (None, None)
    assert cpu_peak.clock_ghz("processor: 0\ncpu MHz\t\t: 2445.406\n\nprocessor: 1\ncpu MHz : 3100.000\n") == 3.1
    assert cpu_peak.clock_ghz("processor: 0\n") is None


def test_step_and_encoder_macs_are_what_the_model_computes():
    """The FLOP counter over the eager decoder step and the encoder (matmuls only, as the formula): the own
    key's dot product and a few elementwise ops are not matmuls, so the count may differ by a hair."""
    cfg = preset("tiny", 96)
    model = build_model(cfg).eval()
    rows, t, src_len = 8, 5, 7
    src = torch.randint(4, 96, (2, src_len))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        memory, _ = model.encode(src)
        model.cross_kv(memory)
    assert counter.get_total_flops() / 2 == pytest.approx(2 * cpu_peak.encoder_macs(cfg, src_len), rel=1e-6)

    h, dh = cfg.n_heads, cfg.d_model // cfg.n_heads
    past = [torch.zeros(2, h, t * 4, dh) for _ in range(cfg.n_dec_layers)]
    index = torch.arange(t)[None, None, :].expand(rows, h, t).contiguous()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.decode_step(torch.full((rows,), 5), torch.tensor([t]), index, torch.zeros(rows, t), past, past,
                          [torch.zeros(2, h, src_len, dh)] * cfg.n_dec_layers,
                          [torch.zeros(2, h, src_len, dh)] * cfg.n_dec_layers, torch.zeros(2, src_len))
    own_keys = rows * cfg.n_dec_layers * 2 * cfg.d_model  # the step's own key and value: elementwise
    counted = counter.get_total_flops() / 2 + own_keys
    assert counted == pytest.approx(cpu_peak.step_macs(cfg, rows, t, src_len), rel=1e-6)


def test_base_costs_what_the_issue_estimated():
    # base at beam 4, 20 source and 30 target tokens: about 176M multiply-adds per target token (issue 46)
    assert cpu_peak.macs_per_target_token(preset("base", 32000), 4, 20, 30) == pytest.approx(174.4e6, rel=1e-3)
    # the shortlist shrinks the output projection (32000 -> 2000 columns) at each of the 31 steps of 4 hypotheses
    saved = 174.4e6 - cpu_peak.macs_per_target_token(preset("base", 32000), 4, 20, 30, vocab=2000)
    assert saved == pytest.approx(4 * 31 * 512 * 30000 / 30, rel=1e-3)


def test_a_row_against_the_peak():
    peak = {"measured": {"int8": 100e9, "fp32": 40e9}, "theoretical": {"int8": 200e9, "fp32": None}}
    row = {"device": "cpu", "precision": "int8", "batch_size": 2, "beam_size": 4, "target_tokens": 60,
           "target_tokens_per_s": 500.0}
    cfg = preset("base", 32000)
    cpu_peak.annotate(row, cfg, [[5] * 19 + [2]] * 2, peak)
    macs = cpu_peak.macs_per_target_token(cfg, 4, 20, 30)
    assert row["macs_per_target_token"] == round(macs)
    assert row["pct_of_measured_peak"] == round(100 * macs * 500 / 100e9, 1)
    assert row["pct_of_theoretical_peak"] == round(100 * macs * 500 / 200e9, 1)
    gpu = {"device": "cuda:0", "target_tokens": 5}
    cpu_peak.annotate(gpu, cfg, [[5]], peak)
    assert "pct_of_measured_peak" not in gpu and cpu_peak.percent(gpu) == "-"


def test_bench_rows_carry_their_share_of_the_peak(fp32_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert run_cli("bench", fp32_dir, "--backends", "onnxruntime", "--batch-size", 2, "--sentences", 4,
                   "--threads", 1, "--json", out) == 0
    report = json.loads(out.read_text())
    assert report["cpu_peak"]["threads"] == 1 and report["cpu_peak"]["measured"]["int8"] > 0
    (row,) = report["results"]
    assert row["macs_per_target_token"] > 0 and row["pct_of_measured_peak"] is not None
    assert "% peak" in capsys.readouterr().out
