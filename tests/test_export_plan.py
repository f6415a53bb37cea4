"""export/plan.resolve: what an export decides before it writes anything (precision, int8 flavour,
limits, TensorRT, tolerances, the checkpoint's own decoding), and that carrying a plan out writes the
same model dir whichever door it came through (export_model or `pipeline export`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import SMALL_LIMITS, hidden, run_cli, run_cli_captured

from export import quantize, tensorrt_build, verify
from export.api import export_model
from export.errors import ExportError
from export.options import DEFAULT_MAX_SRC_LEN, DEFAULT_MAX_TGT_LEN, ExportOptions
from export.plan import ExportPlan, resolve
from export.shortlist import ShortlistCorpus
from model import build_model, preset
from model.checkpoint import load_model, save_checkpoint
from model.manifest import MANIFEST, Limits

HAVE_TRT = tensorrt_build.installed()


def plan(checkpoint: Path, tmp_path: Path, **options) -> ExportPlan:
    return resolve(checkpoint, ExportOptions(out=tmp_path / "m", **options))


def test_plan_of_the_defaults(random_checkpoint, tmp_path):
    p = plan(random_checkpoint, tmp_path, tensorrt=False)
    positions = p.model.cfg.max_positions
    assert p.precision == "fp32" and p.int8_flavour is None and p.tensorrt is False
    assert p.limits == Limits(64, min(DEFAULT_MAX_SRC_LEN, positions), min(DEFAULT_MAX_TGT_LEN, positions - 1), 8)
    assert p.int8_atol == verify.INT8_ATOL and p.tensorrt_skip_note() is None
    assert p.tokenizer is None and p.counted is None  # nothing needs them: not built
    assert p.decoding == {} and p.steps == [] and p.source == random_checkpoint
    assert not p.model.training and next(p.model.parameters()).dtype == torch.float32
    assert not (tmp_path / "m").exists() and hidden(tmp_path) == []  # a plan writes nothing


def test_limits_left_unset_fit_the_models_positions(spm_bytes, tmp_path):
    from runtime.tokenizer import Tokenizer

    ckpt = tmp_path / "short.pt"
    save_checkpoint(ckpt, build_model(preset("tiny", vocab_size=Tokenizer(spm_bytes).vocab_size, max_positions=64)),
                    spm_bytes, train_state={"step": 7}, extra={"decoding": {"beam_size": 3, "alpha": 1.0}})
    p = plan(ckpt, tmp_path, tensorrt=False, max_batch=2, max_beam=2)
    assert p.limits == Limits(2, 64, 63, 2)
    assert p.decoding == {"beam_size": 2, "alpha": 1.0} and p.steps == [7]  # the checkpoint's beam, cut to --max-beam
    assert plan(ckpt, tmp_path, tensorrt=False, max_src_len=10).limits.max_src_len == 10


@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed here")
def test_int8_flavour_and_tolerance_are_decided_per_machine(random_checkpoint, tmp_path):
    """auto: rowwise when no engines will be built (asked not to, or no TensorRT here), with the bound
    of 8-bit activations; the ONNX Runtime-only flavours never build engines and say so."""
    no = plan(random_checkpoint, tmp_path, int8=True, tensorrt=False)
    assert (no.precision, no.int8_flavour, no.tensorrt, no.tensorrt_unavailable) == ("int8", "rowwise", False, None)
    assert no.int8_atol == verify.INT8_ACTIVATIONS_ATOL
    assert no.tensorrt_skip_note() == "int8 flavour rowwise runs on ONNX Runtime only"
    maybe = plan(random_checkpoint, tmp_path, int8=True)
    assert maybe.int8_flavour == quantize.ROWWISE and maybe.tensorrt is False
    assert maybe.tensorrt_unavailable and maybe.tensorrt_skip_note() == (
        f"int8 flavour rowwise runs on ONNX Runtime only; {maybe.tensorrt_unavailable}")
    qdq = plan(random_checkpoint, tmp_path, int8=True, int8_flavour="qdq", int8_atol=0.2)
    assert (qdq.int8_flavour, qdq.int8_atol, qdq.tensorrt, qdq.tensorrt_skip_note()) == ("qdq", 0.2, None, None)
    dynamic = plan(random_checkpoint, tmp_path, int8=True, int8_flavour="ort-dynamic")
    assert dynamic.tensorrt is False and dynamic.tensorrt_unavailable is None  # TensorRT never probed
    assert plan(random_checkpoint, tmp_path, fp16=True, tensorrt=False).precision == "fp16"


def test_contradictions_are_refused_before_the_checkpoint_is_read(random_checkpoint, tmp_path):
    for options, says in [(dict(int8=True, fp16=True), "cannot be combined"),
                          (dict(int8=True, int8_flavour="rowwise", tensorrt=True), "ONNX Runtime only"),
                          (dict(int8_flavour="fp4"), "choose one of auto"),
                          (dict(int8_flavour="rowwise"), "--int8-flavour shapes an int8 export: add --int8"),
                          (dict(no_int8_calibrate=True, int8_atol=0.1), "--no-int8-calibrate and --int8-atol")]:
        with pytest.raises(ExportError, match=says):
            plan(random_checkpoint, tmp_path, **options)
    assert hidden(tmp_path) == [] and not (tmp_path / "m").exists()


def test_references_and_shortlist_share_one_tokenizer(random_checkpoint, tmp_path):
    words = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op", "qr", "st"]
    src = [" ".join(words[(i + k) % 10] for k in range(3)) for i in range(12)]
    corpus = ShortlistCorpus(src, [" ".join(reversed(s.split())) for s in src], ("a.src", "a.tgt"),
                             per_source=2, frequent=4)
    p = plan(random_checkpoint, tmp_path, tensorrt=False, topk=4, max_beam=2, shortlist=corpus,
             references=(["ab cd"], ["AB"]))
    assert p.tokenizer is not None and p.counted is not None and p.counted[1] == 12
    assert p.shortlist is corpus and p.references == (["ab cd"], ["AB"])
    with pytest.raises(ExportError, match="--shortlist-frequent 4 must be at least --topk"):
        plan(random_checkpoint, tmp_path, tensorrt=False, shortlist=corpus)


def test_an_out_that_is_a_symbolic_link_is_refused(random_checkpoint, tmp_path):
    """--force --out LINK replaced the link with a new dir (the linked model dir untouched) and left a hidden
    link behind."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ExportError, match="is a symbolic link"):
        resolve(random_checkpoint, ExportOptions(out=tmp_path / "link", force=True, tensorrt=False))
    assert (tmp_path / "link").is_symlink()


def test_export_model_takes_what_files_hold_not_the_files(random_checkpoint, tmp_path):
    with pytest.raises(TypeError, match="reads no files"):
        export_model(random_checkpoint, tmp_path / "m", reference_src=tmp_path / "x")
    with pytest.raises(TypeError):
        export_model(random_checkpoint, tmp_path / "m", no_such_option=1)


@pytest.mark.slow
def test_the_cli_writes_what_export_model_writes(fp32_dir, random_checkpoint, tmp_path, capsys):
    """conftest's fp32_dir is export_model(random_checkpoint, tensorrt=False, **SMALL_LIMITS): `pipeline
    export` with the same options writes the same bytes, the manifest apart from its timing."""
    out = tmp_path / "m"
    flags = [x for k, v in SMALL_LIMITS.items() for x in (f"--{k.replace('_', '-')}", v)]
    code, _, stderr = run_cli_captured(capsys, "export", random_checkpoint, "--out", out, "--no-tensorrt", *flags)
    assert code == 0, stderr
    assert sorted(f.name for f in out.iterdir()) == sorted(f.name for f in fp32_dir.iterdir())
    for f in fp32_dir.iterdir():
        if f.name != MANIFEST:
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    ours, theirs = (json.loads((d / MANIFEST).read_text()) for d in (out, fp32_dir))
    for m in (ours, theirs):
        m["graphs"].pop("export_seconds")
    assert ours == theirs


def test_decoding_options_given_to_export_go_over_the_checkpoints_own(spm_bytes, tmp_path):
    """tune-decoding's choice, given to export, becomes the model dir's default over what the checkpoint brings
    (an import's generate config); a beam the model dir cannot serve, or a mix that allows no output, is refused
    before any work."""
    from runtime.tokenizer import Tokenizer

    ckpt = tmp_path / "own.pt"
    save_checkpoint(ckpt, build_model(preset("tiny", vocab_size=Tokenizer(spm_bytes).vocab_size)), spm_bytes,
                    extra={"decoding": {"beam_size": 3, "alpha": 1.0, "max_len_a": 0.0, "max_len_b": 20}})
    p = plan(ckpt, tmp_path, tensorrt=False, decoding={"beam_size": 2, "min_len": 5})
    assert p.decoding == {"beam_size": 2, "alpha": 1.0, "max_len_a": 0.0, "max_len_b": 20, "min_len": 5}
    assert plan(ckpt, tmp_path, tensorrt=False).decoding == {"beam_size": 3, "alpha": 1.0, "max_len_a": 0.0,
                                                             "max_len_b": 20}
    with pytest.raises(ExportError, match="--beam-size 5 is above --max-beam 4"):
        plan(ckpt, tmp_path, tensorrt=False, max_beam=4, decoding={"beam_size": 5})
    with pytest.raises(Exception, match="min_len 30 is above the maximum output length 20"):
        plan(ckpt, tmp_path, tensorrt=False, decoding={"min_len": 30})
    with pytest.raises(ExportError, match="--min-len 400 is above the longest output the model dir allows, 305"):
        plan(ckpt, tmp_path, tensorrt=False, decoding={"min_len": 400, "max_len_a": 1.0})
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_export_records_the_decoding_it_was_given_and_serving_uses_it(fp32_dir, random_checkpoint, tmp_path,
                                                                    capsys):
    """`pipeline export --beam-size 2 --alpha 1.0`: the manifest records them, serve-batch decodes with them (as
    the same model dir exported without them does when told), and an option given to serve-batch still wins."""
    from runtime.model_dir import LoadOptions, load

    out = tmp_path / "m"
    flags = [x for k, v in SMALL_LIMITS.items() for x in (f"--{k.replace('_', '-')}", v)]
    code, stdout, stderr = run_cli_captured(capsys, "export", random_checkpoint, "--out", out, "--no-tensorrt",
                                            *flags, "--beam-size", 2, "--alpha", 1.0)
    assert code == 0, stderr
    assert f"{out} decodes with --alpha 1, --beam-size 2 unless told otherwise" in stdout
    assert json.loads((out / MANIFEST).read_text())["decoding"] == {"alpha": 1.0, "beam_size": 2}
    loaded = load(out, LoadOptions(backend="onnxruntime"))
    assert (loaded.decoding.beam_size, loaded.decoding.alpha, loaded.decoding.max_len_b) == (2, 1.0, 50)
    src = tmp_path / "in.txt"
    src.write_text("▁a b c\nhello there\n\nx y z w\n")

    def serve_batch(model_dir: Path, name: str, *options: object) -> str:
        code, _, stderr = run_cli_captured(capsys, "serve-batch", model_dir, src, "--output", tmp_path / name,
                                           "--backend", "onnxruntime", "--nbest", 2, *options)
        assert code == 0, stderr
        return (tmp_path / name).read_text()

    assert serve_batch(out, "ours") == serve_batch(fp32_dir, "told", "--beam-size", 2, "--alpha", 1.0)
    assert serve_batch(out, "wide", "--beam-size", 4) == serve_batch(fp32_dir, "paper4", "--alpha", 1.0)
    assert serve_batch(out, "ours") != serve_batch(fp32_dir, "paper")  # the scores differ with alpha
    assert run_cli("export", random_checkpoint, "--out", tmp_path / "x", "--no-tensorrt", *flags,
                   "--beam-size", 5) == 2
    assert "--beam-size 5 is above --max-beam 4" in capsys.readouterr().err


def test_the_language_pair_from_the_options_or_the_checkpoint(random_checkpoint, tmp_path):
    """What `pipeline serve` routes LibreTranslate's requests by: --src-lang/--tgt-lang, else what the checkpoint
    recorded (an import's), else nothing; each mistake one line."""
    from model.manifest import Languages

    assert plan(random_checkpoint, tmp_path, tensorrt=False).language_pair is None
    p = plan(random_checkpoint, tmp_path, tensorrt=False, src_lang="de", tgt_lang="en")
    assert p.language_pair == Languages(("de",), ("en",))
    for options, needle in (({"src_lang": "de"}, "give both --src-lang and --tgt-lang"),
                            ({"src_lang": "de", "tgt_lang": "de"}, "both de"),
                            ({"src_lang": "de!", "tgt_lang": "en"}, "--src-lang 'de!': give a language code")):
        with pytest.raises(ExportError, match=needle):
            plan(random_checkpoint, tmp_path, tensorrt=False, **options)
    model, spm, _ = load_model(random_checkpoint)
    imported = tmp_path / "imported.pt"
    save_checkpoint(imported, model, spm, extra={"languages": {"source": "nl", "target": "en"}})
    assert plan(imported, tmp_path, tensorrt=False).language_pair == Languages(("nl",), ("en",))
    assert plan(imported, tmp_path, tensorrt=False, src_lang="fy", tgt_lang="en").language_pair == \
        Languages(("fy",), ("en",))  # the options say it last


def test_a_training_runs_languages_come_from_its_corpus_file_names(tmp_path):
    from pipeline.training.trainer import corpus_languages

    def save_dir(src: str, tgt: str) -> Path:
        d = tmp_path / f"{src}-{tgt}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"resolved_options": {"train_src": f"/data/{src}",
                                                                        "train_tgt": f"/data/{tgt}"}}))
        return d / "checkpoint_100.pt"

    assert corpus_languages(save_dir("train.de.gz", "train.en.gz")) == ("de", "en")
    assert corpus_languages(save_dir("corpus.pt-BR", "corpus.en")) == ("pt-BR", "en")
    assert corpus_languages(save_dir("a.txt", "b.txt")) is None  # not two different languages
    assert corpus_languages(save_dir("src", "tgt")) is None  # no suffix
    assert corpus_languages(save_dir("train.src", "train.tgt")) is None  # what a file holds: served as src-tgt
    assert corpus_languages(save_dir("train.tok.de", "train.raw")) is None
    assert corpus_languages(tmp_path / "nowhere" / "x.pt") is None


def test_exporting_a_save_dir_says_which_checkpoint(trained_checkpoint, tmp_path, caplog):
    """Only manifest.json said whether averaged.pt or the latest checkpoint_*.pt was exported."""
    import logging
    import shutil

    from export.plan import ExportError, ExportOptions, resolve

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(trained_checkpoint, run / "checkpoint_00000100.pt")
    (tmp_path / "taken").write_text("x")  # refused right after the choice: nothing of the model is read
    with caplog.at_level(logging.INFO), pytest.raises(ExportError, match="exists and is not a directory"):
        resolve(run, ExportOptions(out=tmp_path / "taken"))
    assert f"{run}: exporting checkpoint_00000100.pt (the latest step checkpoint;" in caplog.text
