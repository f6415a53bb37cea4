"""The one-command GPU check (scripts/gpu_check.sh, docs/gpu.md): its roofline arithmetic against the
model's real parameters and matmul FLOPs, the Marian mapping against our model, the orchestrator's
keep-going rules, and (slow) the whole check in --cpu mode, so it cannot rot between GPU runs."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, cli_env

from model import build_model, preset
from model.config import BOS_ID, EOS_ID
from pipeline.evaluation import roofline
from runtime.torch_backend import TorchBackend


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return build_model(preset("tiny", vocab_size=61)).eval()


def random_ids(n: int, vocab: int, seed: int, eos: bool = True) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(3, 9))] + ([EOS_ID] if eos else []) for _ in range(n)]


# -- roofline arithmetic ---------------------------------------------------------------------------


def test_step_weights_are_the_decoder_parameters_a_step_reads(tiny_model):
    """Every decoder parameter but the cross-attention K/V projections (run once per sentence in the
    encoder), plus the tied embedding as the output projection."""
    read = sum(p.numel() for name, p in tiny_model.named_parameters()
               if name.startswith("decoder.") and ".cross_attn.k_proj." not in name
               and ".cross_attn.v_proj." not in name)
    read += tiny_model.embed.weight.numel()
    shape = roofline.Shape.of(tiny_model.cfg)
    assert roofline.step_weight_elements(shape) == read
    assert roofline.step_cost(shape, 2, 3, 0, 5).weight_bytes == 4 * read
    assert roofline.step_cost(shape, 2, 3, 0, 5, weight_bytes=2).weight_bytes == 2 * read


def test_base_shape_numbers():
    """The paper's base model with a 32k vocabulary: 38.5M weights read per step, 43% of them the output
    projection (the figure in the design notes)."""
    base = roofline.Shape(d_model=512, n_heads=8, d_ff=2048, n_dec_layers=6, vocab_size=32000)
    elements = roofline.step_weight_elements(base)
    assert elements == 6 * (6 * 512 * 512 + 2 * 512 * 2048 + 6 * 512 + 2048 + 512 + 6 * 512) + 32000 * 512
    assert elements == 38_456_320 and round(32000 * 512 / elements, 2) == 0.43
    cost = roofline.step_cost(base, sentences=32, beam=4, t=10, src_len=20)
    assert cost.self_kv_bytes == 2 * 6 * 128 * 11 * 512 * 4
    assert cost.cross_kv_bytes == 2 * 6 * 32 * 20 * 512 * 4
    assert cost.logits_bytes == 2 * 128 * 32000 * 4
    assert cost.linear_flops == 2 * 128 * (6 * (6 * 512 * 512 + 2 * 512 * 2048) + 32000 * 512)
    assert cost.bytes == cost.weight_bytes + cost.self_kv_bytes + cost.cross_kv_bytes + cost.logits_bytes


def test_matmul_flops_match_what_torch_counts_in_a_real_step(tiny_model):
    """FlopCounterMode on TorchBackend.step: the linear layers exactly; the attention matmuls exactly
    but for each hypothesis' own key, which the step scores elementwise (model/transformer.py)."""
    from torch.utils.flop_counter import FlopCounterMode

    backend = TorchBackend(tiny_model)
    cfg, sentences, beam, src_len = tiny_model.cfg, 3, 2, 7
    src = np.array([[5 + (i + j) % 40 for j in range(src_len - 1)] + [EOS_ID] for i in range(sentences)])
    state = backend.encode(src)
    cache = backend.initial_cache(sentences * beam)
    tokens = np.full(sentences * beam, BOS_ID)
    reorder = np.arange(sentences * beam)
    shape = roofline.Shape.of(cfg)
    rows = sentences * beam
    for t in range(4):
        with FlopCounterMode(display=False) as counter:
            out, cache = backend.step(state, tokens, t, cache, reorder)
        counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
        cost = roofline.step_cost(shape, sentences, beam, t, src_len)
        assert counts.get("aten.addmm", 0) + counts.get("aten.mm", 0) == cost.linear_flops
        own_key = 0 if t == 0 else 2 * 2 * rows * cfg.d_model * cfg.n_dec_layers  # t == 0: one masked slot
        assert counts["aten.bmm"] == cost.attention_flops - own_key
        tokens = out.topk_ids[:, 0]


def test_decode_cost_sums_steps_and_achieved_is_a_share_of_the_roofline():
    shape = roofline.Shape(d_model=64, n_heads=4, d_ff=256, n_dec_layers=2, vocab_size=1000)
    total = roofline.decode_cost(shape, 4, 4, 31, 20, weight_bytes=2)
    steps = [roofline.step_cost(shape, 4, 4, t, 20, weight_bytes=2) for t in range(31)]
    assert total.bytes == sum(s.bytes for s in steps) and total.flops == sum(s.flops for s in steps)
    bandwidth, rate = 1e12, 1e14
    bound = max(total.bytes / bandwidth, total.flops / rate)
    got = roofline.achieved(total, seconds=2 * bound, bandwidth=bandwidth, flop_rate=rate)
    assert got["roofline_pct"] == pytest.approx(50.0)
    assert got["bandwidth_pct"] == pytest.approx(100 * total.bytes / (2 * bound) / bandwidth)
    assert total.to_dict()["bytes"] == total.bytes
    with pytest.raises(ValueError):
        roofline.step_cost(shape, 0, 4, 0, 20)


def test_measurements_run_on_the_cpu():
    copy = roofline.measure_copy_bandwidth("cpu", 1 << 20, repeats=2)
    matmul = roofline.measure_matmul_rate("cpu", "fp32", 64, repeats=2)
    assert copy["bytes_per_s"] > 0 and matmul["flops_per_s"] > 0


# -- the Marian peer -------------------------------------------------------------------------------


def test_marian_computes_our_model(tiny_model):
    pytest.importorskip("transformers")
    from pipeline.evaluation import marian_peer

    marian = marian_peer.to_marian(tiny_model)
    cfg = marian.config
    assert (cfg.scale_embedding, cfg.activation_function, cfg.pad_token_id, cfg.eos_token_id,
            cfg.decoder_start_token_id) == (True, "relu", 0, 3, 2)
    pe = tiny_model.pe[: cfg.max_position_embeddings]
    assert torch.equal(marian.model.encoder.embed_positions.weight, pe)  # ours, interleaved sin/cos
    assert torch.equal(marian.model.decoder.embed_positions.weight, pe)
    assert torch.equal(marian.lm_head.weight, tiny_model.embed.weight)
    assert not marian.final_logits_bias.any()
    sources = random_ids(6, tiny_model.cfg.vocab_size, 2)
    targets = random_ids(6, tiny_model.cfg.vocab_size, 3, eos=False)
    assert marian_peer.teacher_forced_gap(tiny_model, marian, sources, targets) < 1e-4
    agreement = marian_peer.greedy_agreement(tiny_model, marian, sources, max_len=12)
    assert agreement["identical"] == agreement["sentences"] == 6, agreement
    row = marian_peer.time_generate(marian, sources[:4], 2, 2, 5)
    assert row["target_tokens"] == 4 * 5 and row["peak_gpu_mib"] is None  # exactly new_tokens per sentence


def test_an_unknown_marian_tensor_is_an_error_not_a_random_weight():
    pytest.importorskip("transformers")
    from model.errors import UserError
    from pipeline.evaluation import marian_peer

    assert marian_peer.our_name("model.decoder.layers.1.encoder_attn.k_proj.weight") == \
        "decoder.1.cross_attn.k_proj.weight"
    assert marian_peer.our_name("model.encoder.layers.0.final_layer_norm.bias") == "encoder.0.res_ffn.norm.bias"
    with pytest.raises(UserError, match="layernorm_embedding"):
        marian_peer.our_name("model.decoder.layernorm_embedding.weight")


# -- the orchestrator ------------------------------------------------------------------------------


def test_a_failed_or_hung_stage_is_recorded_and_the_next_one_runs(tmp_path):
    gpu_check = load_gpu_check()
    check = gpu_check.Check(tmp_path / "out", gpu_check.MODES["cpu"], 60, tmp_path / "work")

    def crashes(st, deadline):
        check.cmd(st, [sys.executable, "-c", "import sys; print('error: the thing broke', file=sys.stderr); "
                                             "sys.exit(3)"], deadline)

    def hangs(st, deadline):
        check.cmd(st, [sys.executable, "-c", "import time; time.sleep(60)"], time.monotonic() + 1)

    def skips(st, deadline):
        raise gpu_check.Skip("needs a GPU")

    assert check.run("doctor", crashes).status == "FAIL"
    assert check.stages["doctor"].reason == "exit status 3: error: the thing broke"
    assert "the thing broke" in check.stages["doctor"].stderr_tail
    started = time.monotonic()
    assert check.run("nvidia-smi", hangs).status == "FAIL"
    assert time.monotonic() - started < 20 and "timed out" in check.stages["nvidia-smi"].reason
    assert check.run("train", skips).status == "SKIP"
    assert check.run("bench", lambda st, deadline: "fine").status == "PASS"
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [s["status"] for s in report["stages"][:4]] == ["FAIL", "FAIL", "PENDING", "SKIP"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| doctor | FAIL |" in md and "the thing broke" in md


def test_the_file_stage_fails_when_the_default_is_slower_than_one_step_per_replay():
    """The H200's first file stage (2026-11-29) passed with the default 2.8x slower than --steps-per-replay 1."""
    load_gpu_check()
    from gpucheck.stages_file import default_problem

    run = {"lines": 20000, "translate_s": 4.62}
    assert default_problem({**run, "translate_s": 12.87}, {**run, "same_lines_as_default": 20000}).startswith(
        "the default took 12.87 s to translate the file, 2.79x")
    assert default_problem({**run, "translate_s": 5.5}, {**run, "same_lines_as_default": 19000}) is None
    assert "2001 of 20000 lines differ" in default_problem(run, {**run, "same_lines_as_default": 17999})


def test_every_module_of_the_check_is_at_most_400_lines():
    """scripts/gpu_check.py (the entry point) and its parts in scripts/gpucheck/, split by stage."""
    modules = [ROOT / "scripts" / "gpu_check.py", *sorted((ROOT / "scripts" / "gpucheck").glob("*.py"))]
    assert len(modules) > 5
    long = {p.name: n for p in modules if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_last_logged_step_ignores_torn_lines(tmp_path):
    gpu_check = load_gpu_check()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"event": "train", "step": 10}\n{"event": "valid", "step": 20}\n{"event": "train", "st')
    assert gpu_check.last_logged_step(metrics) == 10
    assert gpu_check.last_logged_step(tmp_path / "missing.jsonl") == 0


# -- the whole check on the CPU --------------------------------------------------------------------

GPU_ONLY = {"nvidia-smi", "onnxruntime-cuda"}  # stages that need a GPU and say so in --cpu mode


@pytest.mark.slow
def test_the_whole_check_passes_in_cpu_mode(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), "--cpu", "--budget", "480"],
                          env=cli_env(), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert (out / "report.md").is_file() and (out / "report.json").is_file(), proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    for name, st in stages.items():
        if name in GPU_ONLY:
            assert st["status"] in ("PASS", "SKIP") and st["reason"], st
        else:
            assert st["status"] == "PASS", f"{name}: {st['reason']}\n{st['stderr_tail']}"
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert stages["resume"]["data"]["comparison"]["identical"]
    assert any(p["backend"] == "onnxruntime" for p in stages["parity-onnxruntime-fp16"]["data"]["parity"]["results"])

    assert report["bench"], "no bench rows"
    for row in report["bench"]:
        assert row["target_tokens_per_s"] > 0 and row["latency_ms_per_sentence"] > 0
        assert row["target_tokens"] == 30 * row["sentences"]  # --fixed-length 30
        assert row["peak_rss_mb"] and "peak_gpu_mib" in row
    assert {r["batch_size"] for r in report["bench"]} == {1, 4} and report["bench_cli"]

    marian = report["marian"]
    assert marian["agreement"]["identical"] == marian["agreement"]["sentences"] > 0
    assert marian["teacher_forced_gap"] < 1e-3
    assert {(r["preset"], r["batch_size"]) for r in marian["rows"]} == {(r["preset"], r["batch_size"])
                                                                        for r in report["bench"]}
    assert all(r["target_tokens"] == 30 * r["sentences"] for r in marian["rows"])

    roof = report["roofline"]
    assert roof["machine"]["copy"]["bytes_per_s"] > 0 and roof["machine"]["matmul"]["fp32"]["flops_per_s"] > 0
    assert roof["rows"]
    for row in roof["rows"]:
        assert row["steps"] == 31 and row["cost"]["bytes"] > 0 and row["cost"]["flops"] > 0
        assert 0 < row["achieved"]["roofline_pct"] <= 100

    md = (out / "report.md").read_text()
    for name in stages:
        assert f"| {name} |" in md
    assert "## Roofline of one decoder step" in md and "ours / Marian" in md
    assert report["suggested_benchmark_file"].startswith("benchmarks/") and report["wall_s"] > 0
    assert (out / "logs").is_dir() and not Path(report["work_dir"]).exists()  # the large files are gone
