"""A multilingual model dir (a tiny M2M-100 made here, imported and exported) served by `pipeline serve`: its
manifest's languages are LibreTranslate's routes, and each request's source and target reach the model as its
language tokens, so LibreTranslate's /translate writes what `serve-batch --src-lang --tgt-lang --split sentences`
writes, in both directions, with requests of different targets in the app at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("starlette")
pytest.importorskip("sentencex")

from click.testing import CliRunner  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from model.errors import UserError  # noqa: E402
from pipeline.cli import cli  # noqa: E402
from pipeline.corpus.synthetic import generate  # noqa: E402
from pipeline.importers.m2m100 import import_m2m100  # noqa: E402
from pipeline.serve.app import create_app  # noqa: E402
from pipeline.serve.metrics import Metrics  # noqa: E402
from pipeline.serve.options import RequestLimits, ServeHttpOptions  # noqa: E402
from pipeline.serve.runner import load_model  # noqa: E402
from pipeline.serve.state import ServerState  # noqa: E402
from runtime.decoding import PAPER  # noqa: E402
from runtime.model_dir import LoadOptions  # noqa: E402
from tests.m2m100_fixture import make_m2m100_dir  # noqa: E402

SHAPE = dict(encoder_layers=2, decoder_layers=1, encoder_ffn=96, decoder_ffn=64, encoder_heads=4, decoder_heads=2)


@pytest.fixture(scope="module")
def m2m_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("m2m-serve")
    hf = make_m2m100_dir(tmp / "m2m100-tiny", max_length=48, **SHAPE)
    import_m2m100(hf, tmp / "m2m.pt")
    result = CliRunner().invoke(cli, ["export", str(tmp / "m2m.pt"), "--out", str(tmp / "fp32"), "--no-tensorrt"])
    assert result.exit_code == 0, result.output
    return tmp / "fp32"


def serve_batch(model_dir: Path, tmp: Path, texts: list[str], src: str, tgt: str) -> list[str]:
    inp, out = tmp / f"{src}.txt", tmp / f"{src}-{tgt}.out"
    inp.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    result = CliRunner().invoke(cli, ["serve-batch", str(model_dir), str(inp), "-o", str(out), "--src-lang", src,
                                      "--tgt-lang", tgt, "--split", "sentences", "--lang", src, "--backend",
                                      "onnxruntime", "--no-progress"])
    assert result.exit_code == 0, result.output
    return out.read_text(encoding="utf-8").split("\n")[:-1]


@pytest.mark.slow
def test_libretranslate_routes_a_multilingual_model_by_its_languages(m2m_dir, tmp_path):
    en, de = generate(6, seed=4)
    metrics, limits = Metrics(), RequestLimits()
    opts = ServeHttpOptions(load=LoadOptions(backend="onnxruntime", threads=1))
    model = load_model("m2m", str(m2m_dir), opts, PAPER.replace(batch_tokens=limits.max_batch_tokens), metrics)
    languages = json.loads((m2m_dir / "manifest.json").read_text())["model_config"]["languages"]
    assert set(model.sources) == {code for code, _ in languages}  # from the manifest, not the name
    state = ServerState({"m2m": model}, limits, {}, metrics, warmed_up=True)
    with TestClient(create_app(state)) as c:
        listed = {lang["code"]: lang["targets"] for lang in c.get("/languages").json()}
        assert "de" in listed["en"] and "en" in listed["de"] and "en" not in listed["en"]
        doc = f"{en[0]}. {en[1]}!"
        for q, src, tgt in (([doc, en[2]], "en", "de"), (de[:3], "de", "en")):
            r = c.post("/translate", json={"q": q, "source": src, "target": tgt})
            assert r.status_code == 200, r.text
            assert r.json()["translatedText"] == serve_batch(m2m_dir, tmp_path, q, src, tgt)
        r = c.post("/translate", json={"q": "x", "source": "en", "target": "xx"})
        assert r.status_code == 400 and "it translates" in r.json()["error"]


@pytest.mark.slow
def test_native_api_takes_source_and_target_for_a_multilingual_model(m2m_dir, tmp_path):
    """The native /translate names "source" and "target": what serve-batch --src-lang --tgt-lang writes, the
    languages required by a multilingual model, an unknown one a 400 naming the field and the model's languages;
    /info lists the languages."""
    en, de = generate(4, seed=9)
    metrics, limits = Metrics(), RequestLimits()
    opts = ServeHttpOptions(load=LoadOptions(backend="onnxruntime", threads=1))
    model = load_model("m2m", str(m2m_dir), opts, PAPER.replace(batch_tokens=limits.max_batch_tokens), metrics)
    state = ServerState({"m2m": model}, limits, {}, metrics, warmed_up=True)
    with TestClient(create_app(state)) as c:
        assert "de" in c.get("/info").json()["models"]["m2m"]["languages"]["target"]
        for text, src, tgt in ((en, "en", "de"), (de, "de", "en")):
            r = c.post("/translate", json={"text": text, "source": src, "target": tgt, "split": "sentences"})
            assert r.status_code == 200, r.text
            assert r.json()["translations"] == serve_batch(m2m_dir, tmp_path, text, src, tgt)
        r = c.post("/translate", json={"text": en, "target": "de"})
        assert r.status_code == 400 and r.json()["error"].startswith('"source" is required'), r.text
        r = c.post("/translate", json={"text": en, "source": "en", "target": "fr"})
        assert r.status_code == 400 and "\"target\" 'fr' is not a language of this model" in r.json()["error"]
        r = c.post("/translate", json={"text": en, "source": 3, "target": "de"})
        assert r.status_code == 400 and '"source" must be a language code' in r.json()["error"]


@pytest.mark.slow
def test_a_text_in_the_target_language_comes_back_as_it_came_on_every_surface(m2m_dir, tmp_path):
    """en -> en on a multilingual model: LibreTranslate's API answered each text as it came, while the native API,
    serve-batch and the Ray / Spark Translator ran the model, which invented a "translation" (and forced a
    glossary's terms into it). The text service copies every text in the source language, on every surface."""
    from pipeline.integrations.translator import Translator
    from pipeline.serve_batch.translation import ServeBatchOptions

    texts = ["sum silos lotato. ka mobalo da kotas!", "", "<b>da nomo</b> linapa &copy &#65 &ampx"]
    metrics, limits = Metrics(), RequestLimits()
    opts = ServeHttpOptions(load=LoadOptions(backend="onnxruntime", threads=1))
    model = load_model("m2m", str(m2m_dir), opts, PAPER.replace(batch_tokens=limits.max_batch_tokens), metrics)
    state = ServerState({"m2m": model}, limits, {}, metrics, warmed_up=True)
    same = {"source": "en", "target": "en"}
    with TestClient(create_app(state)) as c:
        assert c.post("/translate", json={"q": texts, **same}).json()["translatedText"] == texts
        for extra in ({}, {"split": "sentences"}, {"format": "html"}, {"glossary": {"silos": "vobi"}}):
            r = c.post("/translate", json={"text": texts, "model": "m2m", **same, **extra})
            assert r.status_code == 200 and r.json()["translations"] == texts, (extra, r.text)
        r = c.post("/translate", json={"text": texts[:2], "model": "m2m", **same, "nbest": 2, "beam_size": 2})
        assert r.json()["translations"] == [{"hypotheses": [{"text": texts[0], "score": 0.0}]},
                                            {"hypotheses": [{"text": "", "score": 0.0}]}], r.text
        lines = c.post("/translate", json={"text": texts, "model": "m2m", **same, "stream": True}).text.splitlines()
        assert [json.loads(line)["translation"] for line in lines] == texts
        # HTML came back with its entities respelled (&copy -> &copy;), and a text of more sentences than
        # --max-sentences was a 413 here while LibreTranslate's API answered it: nothing is translated
        for extra in ({"format": "html", "stream": True}, {"split": "sentences", "stream": True}):
            lines = c.post("/translate", json={"text": texts, "model": "m2m", **same, **extra}).text.splitlines()
            assert "".join(json.loads(line)["translation"] for line in lines) == "".join(texts), extra
        many = ["Ja. " * (limits.max_sentences + 1)]
        r = c.post("/translate", json={"text": many, "model": "m2m", **same, "split": "sentences"})
        assert r.status_code == 200 and r.json()["translations"] == many
        assert c.post("/translate", json={"text": texts, "model": "m2m", "source": "en", "target": "de"}).json()[
            "translations"][0] != texts[0]  # the model does run for another target
    inp = tmp_path / "in.txt"
    inp.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    for extra, want in (([], texts), (["--nbest", "2", "--beam-size", "2"], [f"{t} ||| 0.0000" for t in texts])):
        result = CliRunner().invoke(cli, ["serve-batch", str(m2m_dir), str(inp), "-o", str(tmp_path / "out.txt"),
                                          "--src-lang", "en", "--tgt-lang", "en", "--no-progress", *extra])
        assert result.exit_code == 0, result.output
        assert (tmp_path / "out.txt").read_text(encoding="utf-8").split("\n")[:-1] == want
    rows = Translator(m2m_dir, load_options=LoadOptions(backend="onnxruntime"),
                      options=ServeBatchOptions(src_lang="en", tgt_lang="en")).translate(texts)
    assert rows.translation == texts


def test_language_codes_are_taken_in_any_case_on_every_surface(m2m_dir, tmp_path):
    """The native and LibreTranslate APIs took "EN" (LibreTranslate lowercases codes) while serve-batch and the
    Ray / Spark Translator refused --src-lang EN ("did you mean en?"); every surface takes the model's codes in any
    case now, and the Translator's errors name its own fields (they said --src-lang to a Python caller)."""
    from pipeline.integrations.translator import Translator
    from pipeline.serve_batch.translation import ServeBatchOptions

    texts = ["sum silos lotato. ka mobalo da kotas!", "da nomo linapa"]
    assert serve_batch(m2m_dir, tmp_path, texts, "EN", "De") == serve_batch(m2m_dir, tmp_path, texts, "en", "de")
    load = LoadOptions(backend="onnxruntime", threads=1)
    given = ServeBatchOptions(src_lang="EN", tgt_lang="DE", split="sentences")
    rows = Translator(m2m_dir, load_options=load, options=given)
    assert (rows.direction.source, rows.direction.target) == ("en", "de") and rows.options.lang == "en"
    assert rows.translate(texts).translation == serve_batch(m2m_dir, tmp_path, texts, "en", "de")
    with pytest.raises(UserError, match=r"^tgt_lang 'fr' is not a language of this model"):
        Translator(m2m_dir, load_options=load, options=ServeBatchOptions(src_lang="en", tgt_lang="fr"))


def test_ray_translate_says_a_same_language_job_writes_each_line_as_it_came(m2m_dir, tmp_path, monkeypatch, caplog):
    """ray-translate en -> en with a glossary said only "the glossary's terms: 0 found in the input" (at INFO),
    where serve-batch says every line is written as it came; the cluster's part stands in here (its output is
    test_ray_translate.py's), the command's own notices are what is checked."""
    import logging

    from pipeline.integrations import ray_job

    def cluster(*args: object, **kwargs: object) -> ray_job.JobStats:
        return ray_job.JobStats(lines=2, empty=0, actors=1, fit=1)

    monkeypatch.setattr(ray_job, "translate_shards", cluster)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("sum silos lotato.\nda nomo\n", encoding="utf-8")
    (tmp_path / "g.tsv").write_text("silos\tvobi\n", encoding="utf-8")
    with caplog.at_level(logging.INFO):
        result = CliRunner().invoke(cli, ["ray-translate", str(m2m_dir), str(tmp_path / "in"), "--output-dir",
                                          str(tmp_path / "out"), "--src-lang", "en", "--tgt-lang", "en",
                                          "--glossary", str(tmp_path / "g.tsv"), "--no-progress"])
    assert result.exit_code == 0, result.output
    said = {(r.levelname, r.getMessage()) for r in caplog.records}
    assert ("INFO", "--src-lang and --tgt-lang are both en: every line is written as it came (a model would "
            "invent a translation)") in said, said
    assert ("WARNING", "the glossary's terms: 0 found in the input, 0 of them in the translations") in said, said


def test_codes_in_another_case_name_and_record_a_job_as_the_model_spells_them(m2m_dir, tmp_path, monkeypatch):
    """serve-batch --tgt-lang DE named its outputs x.DE where ray-translate wrote x.de, and ray-translate recorded
    the job's sentence rules as "DE", so a rerun with de (more inputs) was refused as other options."""
    from pipeline.integrations import ray_job

    monkeypatch.setattr(ray_job, "translate_shards", lambda *a, **k: ray_job.JobStats(lines=1, empty=0, actors=1,
                                                                                      fit=1))
    (tmp_path / "in").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "in" / name).write_text("sum silos lotato. da nomo\n", encoding="utf-8")
    out = tmp_path / "out"

    def ray(src: str, tgt: str, *inputs: str) -> object:
        return CliRunner().invoke(cli, ["ray-translate", str(m2m_dir), *(str(tmp_path / "in" / i) for i in inputs),
                                        "--output-dir", str(out), "--src-lang", src, "--tgt-lang", tgt, "--split",
                                        "sentences", "--no-progress"])

    result = ray("EN", "DE", "a.txt")
    assert result.exit_code == 0, result.output
    (out / "a.txt.de").write_text("x\n", encoding="utf-8")  # the shard the cluster would have written
    result = ray("en", "de", "a.txt", "b.txt")  # the same job, one input more: resumed
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(cli, ["serve-batch", str(m2m_dir), str(tmp_path / "in" / "a.txt"), "--output-dir",
                                      str(tmp_path / "sb"), "--src-lang", "EN", "--tgt-lang", "DE", "--no-progress",
                                      "--backend", "onnxruntime"])
    assert result.exit_code == 0, result.output
    assert [p.name for p in (tmp_path / "sb").iterdir()] == ["a.txt.de"]
