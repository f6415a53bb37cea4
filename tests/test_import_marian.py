"""`pipeline import marian`: a local random-weight MarianMTModel directory (made here, no download)
imported, exported and served, token for token as transformers' own generate translates it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402
from helpers import run_cli  # noqa: E402

from model.checkpoint import CheckpointError, load_model  # noqa: E402
from model.transformer import sinusoidal_positions  # noqa: E402
from pipeline.cli import cli  # noqa: E402
from pipeline.corpus.synthetic import generate  # noqa: E402
from pipeline.evaluation.parity import DEFAULT_GATES, Gate, run_parity  # noqa: E402
from pipeline.importers.marian import MarianImportError, import_marian  # noqa: E402
from pipeline.serve_batch.translation import ServeBatchOptions  # noqa: E402
from runtime.decoding import PAPER  # noqa: E402
from runtime.model_dir import LoadOptions, load  # noqa: E402
from runtime.tokenizer import load_tokenizer, tokenizer_from_file  # noqa: E402
from runtime.translate import translate_ids  # noqa: E402
from tests.marian_fixture import make_marian_dir, marian_generate  # noqa: E402

MAX_LENGTH = 40


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_marian_dir(tmp_path_factory.mktemp("opus") / "opus-mt-src-tgt", max_length=MAX_LENGTH)


@pytest.fixture(scope="module")
def checkpoint(hf_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("imported") / "marian.pt"
    import_marian(hf_dir, out)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(HF dir, our checkpoint) of a Marian model briefly trained with transformers: peaked distributions
    and learned lengths, as a real model has (int8 parity means little on random weights)."""
    hf = make_marian_dir(tmp_path_factory.mktemp("opus-trained") / "hf", d_model=64, ffn=256,
                         max_length=MAX_LENGTH, train_steps=300)
    out = hf.parent / "marian.pt"
    import_marian(hf, out)
    return hf, out


@pytest.fixture(scope="module")
def texts() -> list[str]:
    sources, _ = generate(24, seed=5)
    return sources


def test_positions_are_marians_table():
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    theirs = MarianSinusoidalPositionalEmbedding(50, 16)
    assert np.array_equal(sinusoidal_positions(50, 16, "halves").numpy(), theirs.create_weight().numpy())


def test_tokenizer_matches_marian_tokenizer(hf_dir, checkpoint, texts):
    ours = load_tokenizer(load_model(checkpoint)[1])
    theirs = transformers.MarianTokenizer.from_pretrained(str(hf_dir))
    odd = texts[:8] + ["", "zzqx unknown ÆØÅ pieces", ">>tgt<< " + texts[0]]
    assert ours.encode_source(odd) == [theirs(t)["input_ids"] for t in odd]
    generated = marian_generate(hf_dir, texts[:8], num_beams=1, max_length=MAX_LENGTH)
    assert ours.decode(generated) == theirs.batch_decode(generated, skip_special_tokens=True)


def test_import_records_config_and_decoding_defaults(checkpoint, hf_dir):
    model, tok_bytes, payload = load_model(checkpoint)
    cfg = model.cfg
    config = json.loads((hf_dir / "config.json").read_text())
    assert (cfg.activation, cfg.positions, cfg.scale_embedding) == ("swish", "halves", True)
    assert (cfg.eos_id, cfg.pad_id, cfg.bos_id) == (0, config["pad_token_id"], config["pad_token_id"])
    assert cfg.suppress_ids == (config["pad_token_id"],) and cfg.logits_bias
    assert payload["extra"]["decoding"] == {"rules": "transformers", "beam_size": 4, "alpha": 1.0,
                                            "max_len_a": 0.0, "max_len_b": MAX_LENGTH - 2, "min_len": 0}
    assert payload["extra"]["imported"]["directory"] == str(hf_dir.resolve())
    # tokenizer_config.json's source_lang / target_lang: served under LibreTranslate's API by them
    assert payload["extra"]["languages"] == {"source": "src", "target": "tgt"}


@pytest.mark.parametrize("beam", [1, 4])
def test_torch_backend_translates_as_generate(checkpoint, hf_dir, texts, beam):
    """The imported checkpoint on our torch backend, with the model's own decoding defaults."""
    from runtime.torch_backend import open_checkpoint

    backend, tokenizer = open_checkpoint(checkpoint)
    _, _, payload = load_model(checkpoint)
    decoding = PAPER.replace(beam_size=beam, explicit=frozenset({"beam_size"})).for_model(
        payload["extra"]["decoding"])
    ours = [h[0].tokens for h in translate_ids(backend, tokenizer.encode_source(texts), decoding)]
    theirs = marian_generate(hf_dir, texts, num_beams=beam, max_length=MAX_LENGTH)
    assert ours == theirs
    if beam > 1:  # beam search's finishing rules matter only when hypotheses end at different steps
        assert len({len(t) for t in theirs}) >= 3, "the fixture should end sentences at varied lengths"


@pytest.mark.slow
def test_import_export_serve_and_parity_against_transformers(trained, tmp_path):
    """The three user commands, then parity --reference transformers: 100% token-identical at beam 1
    and 4, fp32 (torch and onnxruntime); the int8 dir passes its gate against human references."""
    hf_dir, checkpoint = trained
    texts, human = generate(40, seed=5)
    runner = CliRunner()
    src, ref, human_ref = tmp_path / "src.txt", tmp_path / "ref.txt", tmp_path / "human.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    human_ref.write_text("\n".join(human) + "\n", encoding="utf-8")
    fp32, fp16, int8 = tmp_path / "fp32", tmp_path / "fp16", tmp_path / "int8"
    # int8: the export's step check at 0.4, not 0.3 (+ 5%): on an AVX-512 VNNI CPU this briefly trained model's
    # dynamic int8 step differed by 0.485 at its worst candidate, just over the 0.485 bound (under it on AVX2);
    # the gate that matters, the parity against human references below, holds on both
    for out, flags in ((fp32, []), (fp16, ["--fp16"]), (int8, ["--int8", "--int8-atol", "0.4"])):
        result = runner.invoke(cli, ["export", str(checkpoint), "--out", str(out), "--no-tensorrt", *flags])
        assert result.exit_code == 0, result.output
    manifest = json.loads((fp32 / "manifest.json").read_text())
    assert manifest["decoding"]["rules"] == "transformers"
    # serve-batch with the model's defaults (beam 4) writes transformers' translations
    theirs_text = transformers_translations(hf_dir, texts, 4)
    ref.write_text("\n".join(theirs_text) + "\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    result = runner.invoke(cli, ["serve-batch", str(fp32), str(src), "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text(encoding="utf-8").splitlines() == theirs_text
    for beam in (1, 4):
        opts = ServeBatchOptions(decoding=PAPER.replace(beam_size=beam, explicit=frozenset({"beam_size"})))
        report = run_parity(fp32, src, ref, ["torch", "onnxruntime"], opts=opts, reference_engine="transformers",
                            gates={"fp32": Gate(min_identical=1.0, max_bleu_delta=0.0)})
        assert report.passed, [r.failures for r in report.results]
        assert [r.identical for r in report.results] == [1.0, 1.0]
    for reduced in (fp16, int8):
        report = run_parity(reduced, src, human_ref, ["onnxruntime"], reference_engine="transformers",
                            gates=DEFAULT_GATES)
        assert report.passed, [r.failures for r in report.results]
    result = runner.invoke(cli, ["doctor", str(int8)])
    assert result.exit_code == 0 and "onnxruntime" in result.output, result.output
    # CTranslate2 gets the same model through its own converter, proven by greedy agreement first
    from pipeline.evaluation.whole_process import run_whole_process

    report = run_whole_process([fp32], [src], compare=["ctranslate2"], threads=1, beam_size=2, fixed_length=None,
                               rounds=1)
    assert report["ctranslate2_converter"].startswith("ctranslate2.converters.TransformersConverter")
    assert report["ctranslate2_greedy_agreement"] == "8/8"
    assert {(r["engine"], r["precision"]) for r in report["results"]} == {
        ("onnxruntime", "fp32"), ("ctranslate2", "fp32"), ("ctranslate2", "int8")}
    assert served_over_http(fp32, texts, tmp_path / "serve.log") == theirs_text


def test_parity_against_transformers_with_min_len_and_a_line_past_the_positions(trained, tmp_path):
    """`parity --reference transformers` refused a model dir whose generation_config.json ships min_length
    (--min-len 0, its way round, then failed the gate: transformers kept min_length), and a source line longer
    than the model's positions was an IndexError with a traceback (serve-batch cuts it). Both now compare token
    for token: min_length is min_len + 1, the long line cut as serve-batch cuts it."""
    hf_dir, checkpoint = trained
    texts, _ = generate(12, seed=9)
    texts.append(" ".join(texts * 40))  # ~1,500 pieces: past the positions
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    ref.write_text("\n".join(texts) + "\n", encoding="utf-8")
    fp32 = tmp_path / "fp32"
    result = CliRunner().invoke(cli, ["export", str(checkpoint), "--out", str(fp32), "--no-tensorrt"])
    assert result.exit_code == 0, result.output
    opts = ServeBatchOptions(decoding=PAPER.replace(min_len=6, explicit=frozenset({"min_len"})))
    report = run_parity(fp32, src, ref, ["torch"], opts=opts, reference_engine="transformers",
                        gates={"fp32": Gate(min_identical=1.0, max_bleu_delta=0.0)})
    assert report.passed and report.results[0].identical == 1.0, [r.failures for r in report.results]


def test_parity_against_transformers_with_a_length_limit_past_the_positions(checkpoint, texts, tmp_path):
    """--max-len-b 300 (or a generation_config.json's max_length of 100000, which import takes) on a model of 128
    positions: our search caps the output at the positions, transformers' generate raised an IndexError there (a
    traceback). The limit is capped alike: random weights run every sentence to it, token for token."""
    src = tmp_path / "src.txt"
    src.write_text("\n".join(texts[:4]) + "\n", encoding="utf-8")
    fp32 = tmp_path / "fp32"
    result = CliRunner().invoke(cli, ["export", str(checkpoint), "--out", str(fp32), "--no-tensorrt"])
    assert result.exit_code == 0, result.output
    opts = ServeBatchOptions(decoding=PAPER.replace(beam_size=1, max_len_b=300, rules="transformers",
                                                    explicit=frozenset({"max_len_b", "beam_size"})))
    report = run_parity(fp32, src, src, ["torch"], opts=opts, reference_engine="transformers",
                        gates={"fp32": Gate(min_identical=1.0, max_bleu_delta=0.0)})
    assert report.passed and report.results[0].identical == 1.0, [r.failures for r in report.results]


def served_over_http(model_dir: Path, texts: list[str], log_path: Path) -> list[str]:
    """`pipeline serve MODEL_DIR` (the model's own decoding defaults) answering one request."""
    import re
    import subprocess
    import sys
    import time

    import httpx

    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", str(model_dir), "--port", "0",
                                 "--backend", "onnxruntime", "--threads", "1"], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while not (m := re.search(r"at (http://127\.0\.0\.1:\d+)", log_path.read_text())):
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.2)
            while True:
                try:
                    answer = httpx.post(f"{m.group(1)}/translate", json={"text": texts}, timeout=120)
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, log_path.read_text()
                    time.sleep(0.2)
            assert answer.status_code == 200, answer.text
            return [t if isinstance(t, str) else t["text"] for t in answer.json()["translations"]]
        finally:
            proc.terminate()
            proc.wait(30)


def transformers_translations(hf_dir: Path, texts: list[str], beam: int) -> list[str]:
    from tests.marian_fixture import marian_translate

    return marian_translate(hf_dir, texts, num_beams=beam, max_length=MAX_LENGTH)


def test_cli_overrides_the_models_defaults(checkpoint, tmp_path):
    """--beam-size given on the command line wins over the model's num_beams; the rest stay the model's."""
    from runtime.decoding import DecodingOptions

    defaults = load_model(checkpoint)[2]["extra"]["decoding"]
    given = PAPER.replace(beam_size=2, explicit=frozenset({"beam_size"})).for_model(defaults)
    assert (given.beam_size, given.rules, given.alpha, given.max_len_b) == (2, "transformers", 1.0, MAX_LENGTH - 2)
    assert DecodingOptions(beam_size=3).for_model(defaults).beam_size == 3  # programmatic: what differs from PAPER
    assert PAPER.for_model(defaults).beam_size == 4


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "target.spm").unlink(), "target.spm: missing"),
    (lambda d: (d / "model.safetensors").unlink(), "model.safetensors: missing"),
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "bart", "vocab_size": 10})),
     'config.json: model_type "bart", not "marian"'),
    (lambda d: (d / "vocab.json").write_text(json.dumps(
        {**json.loads((d / "vocab.json").read_text()), "extra-piece-xyz": 10 ** 6})), "vocab.json:"),
    (lambda d: (d / "config.json").write_text(json.dumps(
        {**json.loads((d / "config.json").read_text()), "vocab_size": 7})), "decoder_vocab_size 375 differs"),
    (lambda d: (d / "config.json").write_text(json.dumps(
        {**json.loads((d / "config.json").read_text()), "vocab_size": 400, "decoder_vocab_size": 400})),
     "config.json: vocab_size 400, d_model 32 disagree with model.safetensors"),  # the header, before vocab.json
    (lambda d: (d / "config.json").write_text(json.dumps(
        {**json.loads((d / "config.json").read_text()), "share_encoder_decoder_embeddings": False})),
     "share_encoder_decoder_embeddings is false (separate vocabularies); our model has one embedding"),
])
def test_bad_directory_is_one_line_naming_the_file(hf_dir, tmp_path, damage, message):
    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    damage(broken)
    out = tmp_path / "out.pt"
    result = CliRunner().invoke(cli, ["import", "marian", str(broken), "--out", str(out)])
    assert result.exit_code != 0
    assert isinstance(result.exception, MarianImportError), result.output
    assert message in str(result.exception) and "\n" not in str(result.exception)
    assert not out.exists(), "a failed import leaves no checkpoint"


def test_import_is_atomic_and_checksummed(hf_dir, checkpoint, tmp_path):
    out = tmp_path / "m.pt"
    out.write_bytes(b"previous")
    with pytest.raises(MarianImportError, match="exists; pass --force"):
        import_marian(hf_dir, out)
    assert out.read_bytes() == b"previous"
    import_marian(hf_dir, out, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["m.pt"], "no temp file left beside it"
    data = bytearray(out.read_bytes())
    data[len(data) // 2] ^= 0xFF
    out.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256|checksum|corrupt"):
        load_model(out)


@pytest.mark.slow
def test_model_dir_tokenizer_and_limits(checkpoint, tmp_path):
    """export caps its default source/target limits to the model's positions; the model dir's tokenizer is
    the bundle."""
    from export.api import export_model

    out = tmp_path / "dir"
    manifest = export_model(checkpoint, out, tensorrt=False)
    assert manifest.limits.max_src_len <= manifest.model_config.max_positions
    assert manifest.limits.max_tgt_len < manifest.model_config.max_positions
    loaded = load(out, LoadOptions(backend="onnxruntime"))
    tokenizer, manifest = loaded.tokenizer, loaded.manifest
    assert tokenizer.vocab_size == manifest.model_config.vocab_size
    assert type(tokenizer_from_file(out / "spm.model")).__name__ == "VocabTokenizer"
    # the pair the import recorded: `pipeline serve DIR` serves it under LibreTranslate's API, whatever its name
    from pipeline.serve.languages import served_languages
    assert served_languages("model", manifest) == (("src",), ("tgt",))


def test_an_opus_mt_model_dir_serves_the_lengths_its_generation_config_allows(tmp_path, caplog):
    """OPUS-MT ships 512 positions and max_length 512: export's defaults (256 source, 306 target tokens) cut its
    outputs at 305 tokens without a word, where transformers writes 510, and parity failed without a reason. The
    model's own decoding sets the default limits; limits given that cut them are warned of."""
    import logging

    from export.api import export_model

    hf = make_marian_dir(tmp_path / "hf", max_position_embeddings=512, max_length=512, calibrate=False)
    checkpoint = tmp_path / "marian.pt"
    import_marian(hf, checkpoint)
    manifest = export_model(checkpoint, tmp_path / "dir", tensorrt=False)
    assert (manifest.limits.max_src_len, manifest.limits.max_tgt_len) == (512, 511)
    assert manifest.decoding["max_len_b"] == 510
    with caplog.at_level(logging.WARNING, logger="export.plan"):
        export_model(checkpoint, tmp_path / "short", tensorrt=False, max_tgt_len=306)
    assert "outputs stop at 305 tokens (--max-tgt-len 306), where the checkpoint's decoding allows 510; " \
           "--max-tgt-len 511 serves all of them" in caplog.text
    caplog.clear()  # a source limit that cuts was not warned of, as docs/import.md says it is
    with caplog.at_level(logging.WARNING, logger="export.plan"):
        export_model(checkpoint, tmp_path / "cut", tensorrt=False, max_src_len=100)
    assert "cuts sources at 100 tokens (--max-src-len 100), where the model takes 512; --max-src-len 512 serves " \
           "all of them" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("encoder_layers, decoder_layers, decoder_ffn, decoder_heads",
                         [(3, 1, 32, 2), (1, 2, None, None)])
def test_asymmetric_shapes_import_export_and_serve_as_generate(tmp_path, texts, encoder_layers, decoder_layers,
                                                               decoder_ffn, decoder_heads):
    """A deep-encoder, shallow-decoder student with a narrower decoder (FFN 32 against 64, 2 heads against 4),
    and the reverse depths, import, export and serve token-identical to transformers' generate, at beam 1 and
    at the model's beam 4."""
    hf_dir = make_marian_dir(tmp_path / "hf", layers=encoder_layers, decoder_layers=decoder_layers,
                             max_length=MAX_LENGTH, decoder_ffn=decoder_ffn, decoder_heads=decoder_heads)
    checkpoint = tmp_path / "student.pt"
    import_marian(hf_dir, checkpoint)
    model, _, _ = load_model(checkpoint)
    assert (model.cfg.n_enc_layers, model.cfg.n_dec_layers) == (encoder_layers, decoder_layers)
    assert (model.cfg.d_ff, model.cfg.n_heads) == (decoder_ffn or 64, decoder_heads or 4)
    assert (model.cfg.encoder_d_ff, model.cfg.encoder_heads) == (64, 4)
    from export.api import export_model

    export_model(checkpoint, tmp_path / "model", tensorrt=False)

    src = tmp_path / "src.txt"
    src.write_text("".join(t + "\n" for t in texts[:12]))
    result = CliRunner().invoke(cli, ["serve-batch", str(tmp_path / "model"), str(src), "-o", str(tmp_path / "out"),
                                      "--backend", "onnxruntime", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert len((tmp_path / "out").read_text().splitlines()) == 12
    for beam in (1, 4):
        given = PAPER.replace(beam_size=beam, explicit=frozenset({"beam_size"}))
        loaded = load(tmp_path / "model", LoadOptions(backend="onnxruntime", threads=1), given)
        ours = [h[0].tokens for h in translate_ids(loaded.backend, loaded.tokenizer.encode_source(texts[:12]),
                                                   loaded.decoding)]
        assert ours == marian_generate(hf_dir, texts[:12], num_beams=beam, max_length=MAX_LENGTH), beam


def test_parity_reads_the_import_directory_as_import_does_and_checks_its_files(hf_dir, checkpoint, tmp_path,
                                                                               monkeypatch):
    """parity --reference transformers: an --hf-dir changed since the import (a weight rewritten) failed the
    gate as if our backends were wrong; a hub id or a cache's models--ORG--NAME, which import takes, was "the
    directory this model was imported from is not here; pass --hf-dir" though it was passed; and a damaged
    directory was transformers' traceback (a JSONDecodeError)."""
    from model.errors import UserError
    from pipeline.evaluation.random_model import make_random_checkpoint
    from pipeline.evaluation.transformers_reference import source_dir, translate

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert source_dir(checkpoint, None) == hf_dir.resolve()
    repo = tmp_path / "hub" / "models--Helsinki-NLP--opus-mt-src-tgt"
    shutil.copytree(hf_dir, repo / "snapshots" / ("ab" * 20))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("ab" * 20)
    for given in ("Helsinki-NLP/opus-mt-src-tgt", str(repo)):
        assert source_dir(checkpoint, Path(given)) == repo / "snapshots" / ("ab" * 20)
    with pytest.raises(UserError, match=r"^--hf-dir Helsinki-NLP/opus-mt-xx-yy: no such directory, nor a model in "):
        source_dir(checkpoint, Path("Helsinki-NLP/opus-mt-xx-yy"))
    with pytest.raises(UserError, match=r"^--hf-dir \S+/nope: no such directory$"):
        source_dir(checkpoint, tmp_path / "nope")
    ours = tmp_path / "ours.pt"  # a model trained here: an --hf-dir is another model (0% identical, no word)
    make_random_checkpoint(ours, "tiny", 64, seed=1)
    assert source_dir(ours, None) is None
    with pytest.raises(UserError, match=r"this model was not imported \(trained here\), so no Hugging Face model"):
        source_dir(ours, hf_dir)

    carded = tmp_path / "carded"  # a model card: hashed at import, read by no one
    shutil.copytree(hf_dir, carded)
    (carded / "README.md").write_text("# opus-mt-src-tgt\n")
    import_marian(carded, tmp_path / "carded.pt")
    (carded / "README.md").write_text("# opus-mt-src-tgt, the card edited\n")
    assert source_dir(tmp_path / "carded.pt", None) == carded.resolve()  # (it was "not the file ... imported")
    changed = tmp_path / "changed"
    shutil.copytree(hf_dir, changed)
    weights = next(p for p in changed.iterdir() if p.name in ("model.safetensors", "pytorch_model.bin"))
    data = bytearray(weights.read_bytes())
    data[-8:] = b"\x00\x00\x80\x7f" * 2  # one weight rewritten (inf)
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError, match=rf"^{changed / weights.name}: not the file this model was imported from "
                       r"\(sha256 [0-9a-f]{12}\.\.\., imported [0-9a-f]{12}\.\.\.\); give the directory"):
        source_dir(checkpoint, changed)
    (changed / "config.json").write_text("{not json")
    with pytest.raises(UserError, match=r"^--hf-dir \S+: transformers cannot load it \(.*\); give the directory"):
        translate(changed, ["a b"], PAPER.replace(rules="transformers", max_len_a=0.0, max_len_b=10))


def test_parity_names_a_file_transformers_reads_that_the_import_never_saw(hf_dir, checkpoint, tmp_path, caplog,
                                                                         capsys):
    """A model.safetensors added beside the weights imported (transformers reads it first) failed the gate,
    16.7% identical, naming no file; a tokenizer file deleted since was transformers' "expected str, ... not
    NoneType"; and --hf-dir without --reference transformers was ignored: torch compared with torch, passed."""
    import logging

    from model.errors import UserError
    from pipeline.evaluation.transformers_reference import source_dir

    added = tmp_path / "added"
    shutil.copytree(hf_dir, added)
    weights = next(p for p in added.iterdir() if p.name in ("model.safetensors", "pytorch_model.bin"))
    shutil.copy(weights, added / ("pytorch_model.bin" if weights.name == "model.safetensors" else "model.safetensors"))
    with pytest.raises(UserError, match=r"/added/(model\.safetensors|pytorch_model\.bin): not there when this model "
                       r"was imported, and transformers may read it; give the directory it was imported from"):
        source_dir(checkpoint, added)
    lost = tmp_path / "lost"
    shutil.copytree(hf_dir, lost)
    (lost / "source.spm").unlink()
    with caplog.at_level(logging.WARNING):
        assert source_dir(checkpoint, lost) == lost
    assert "lost: source.spm missing since the import read the directory" in caplog.text
    src = tmp_path / "src.txt"
    src.write_text("a b\n", encoding="utf-8")
    assert run_cli("parity", tmp_path / "none", "--src", src, "--ref", src, "--hf-dir", hf_dir) == 2
    assert ("error: --hf-dir is the directory --reference transformers compares with; add --reference transformers, "
            "or leave --hf-dir out") in capsys.readouterr().err


def test_the_import_line_says_the_pair_it_records(hf_dir, tmp_path):
    """The summary printed the activation alone: the pair LibreTranslate's API will serve went unsaid."""
    result = CliRunner().invoke(cli, ["import", "marian", str(hf_dir), "--out", str(tmp_path / "m.pt")])
    assert result.exit_code == 0, result.output
    assert "activation swish, languages src-tgt;" in result.output


def test_odd_tokenizer_and_generation_values_are_said_in_one_short_line(hf_dir, tmp_path, caplog, capsys):
    """A 5,000-character source_lang in tokenizer_config.json was echoed whole in a 5 KB warning; min_length equal
    to max_length was "min_length 64 is above max_length 64 - 1"."""
    import logging

    odd = tmp_path / "odd"
    shutil.copytree(hf_dir, odd)
    tok = json.loads((odd / "tokenizer_config.json").read_text())
    (odd / "tokenizer_config.json").write_text(json.dumps({**tok, "source_lang": "x" * 5000}))
    with caplog.at_level(logging.WARNING):
        import_marian(odd, tmp_path / "odd.pt")
    [said] = [r.getMessage() for r in caplog.records if "not two language codes" in r.getMessage()]
    assert len(said) < 400 and '"xxxxxxxx' in said
    gen = json.loads((odd / "generation_config.json").read_text())
    (odd / "generation_config.json").write_text(json.dumps({**gen, "min_length": 64, "max_length": 64}))
    assert run_cli("import", "marian", odd, "--out", tmp_path / "odd2.pt") == 2
    assert ("min_length 64 is above 63, the most that max_length 64 leaves (both count the decoder start token)"
            in capsys.readouterr().err)
