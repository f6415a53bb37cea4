"""The Docker image's own command line (deploy/Dockerfile's ENTRYPOINT, run as the image runs it, with /model
replaced by a model dir made here) against the exact requests Mastodon's LibreTranslate provider sends, each
answer checked the way Mastodon parses it (app/lib/translation_service/libre_translate.rb): GET /languages into
{code => targets without the code}, POST /translate with a JSON body {q: [texts], source (or "auto"), target,
format: "html", api_key: null}, 403 read as "quota exceeded", anything but 2xx as a failure."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import with_language_pair
from test_deploy import served_url

pytest.importorskip("starlette")
pytest.importorskip("py3langid")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[1]


def entrypoint() -> tuple[list[str], dict[str, str]]:
    """The image's ENTRYPOINT (exec form) and its ENV lines."""
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    [line] = [ln for ln in text.splitlines() if ln.startswith("ENTRYPOINT ")]
    env = dict(re.findall(r"^ENV (\w+)=(\S+)$", text, re.M))
    return json.loads(line.removeprefix("ENTRYPOINT ")), env


def mastodon_languages(url: str) -> dict:
    r = httpx.get(f"{url}/languages", headers={"Content-Type": "application/json"}, timeout=30)
    assert 200 <= r.status_code < 300, r.text
    languages = {lang["code"]: [t for t in lang["targets"] if t != lang["code"]] for lang in r.json()}
    languages[None] = sorted({t for targets in languages.values() for t in targets})
    return languages


def mastodon_translate(url: str, texts: list[str], source: str | None, target: str) -> list[tuple[str, str]]:
    body = json.dumps({"q": texts, "source": source or "auto", "target": target, "format": "html", "api_key": None})
    r = httpx.post(f"{url}/translate", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code not in (403, 429), f"Mastodon shows this as quota exceeded / too many requests: {r.text}"
    assert 200 <= r.status_code < 300, r.text
    data = r.json()
    assert isinstance(data, dict)
    return [(text, ((data.get("detectedLanguage") or [None] * len(texts))[i] or {}).get("language") or source)
            for i, text in enumerate(data["translatedText"])]


def every_client_translates(url: str) -> None:
    """The other clients of issue 60 against the image's command line: libretranslatepy, deep-translator,
    libretranslate-aio unmodified, and Weblate's and Open WebUI's requests."""
    text = "der hund sieht die katze."
    r = httpx.post(f"{url}/translate", json={"text": [text], "split": "sentences", "source": "de", "target": "en"},
                   timeout=60)
    expected = r.json()["translations"][0]
    libretranslatepy = pytest.importorskip("libretranslatepy")
    assert libretranslatepy.LibreTranslateAPI(url).translate(text, "de", "en") == expected
    from deep_translator import LibreTranslator
    assert LibreTranslator(source="de", target="en", custom_url=f"{url}/", api_key="any").translate(text) == expected
    from libretranslate_aio import LibreTranslate
    with LibreTranslate(url) as client:
        assert client.translate(text, "de", "en").translated_text == expected
    weblate = httpx.post(f"{url}/translate", data={"api_key": "", "q": text, "source": "de", "target": "en"},
                         timeout=60)
    assert weblate.json()["translatedText"] == expected
    webui = httpx.post(f"{url}/translate", json={"q": text, "source": "auto", "target": "en", "format": "text"},
                       timeout=60)
    webui.raise_for_status()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["de-en", None])
def test_the_images_command_line_serves_mastodon(fp32_dir, tmp_path, name):
    """MODEL_NAME=de-en names the pair of a model dir that records none; without it, the image's default name
    serves the native API, and a model dir that records its pair (export --src-lang/--tgt-lang) is served under
    LibreTranslate's API whatever MODEL_NAME is."""
    command, env = entrypoint()
    assert command[:2] == ["/bin/sh", "-c"] and "/model" in command[2]
    model = fp32_dir
    if name is None:  # the image's default MODEL_NAME, with a model dir that records its languages
        model = with_language_pair(fp32_dir, tmp_path / "model", "de", "en")
    script = command[2].replace("/model", shlex.quote(str(model)))
    assert "--host 0.0.0.0 --port 8000" in script  # where EXPOSE and HEALTHCHECK look; here a free port
    script = script.replace("--host 0.0.0.0 --port 8000", "--host 127.0.0.1 --port 0")
    environ = {**os.environ, **env, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    if name is not None:
        environ["MODEL_NAME"] = name
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*command[:2], script, *command[3:], "--backend", "onnxruntime"], cwd=tmp_path,
                                env=environ, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = served_url(proc, log)
        languages = mastodon_languages(url)
        assert languages == {"de": ["en"], "en": [], None: ["en"]}  # Mastodon's permitted?: de -> en
        [(text, detected)] = mastodon_translate(url, ["<p>der hund sieht die katze.</p>"], "de", "en")
        assert text.startswith("<p>") and text.endswith("</p>") and detected == "de"
        got = mastodon_translate(url, ["<p>Der Mann fährt mit dem Fahrrad durch die Stadt.</p>", "<p>🙂</p>"],
                                 None, "en")
        assert got[0][1] == "de" and got[1][0] == "<p>🙂</p>"
        assert "access: POST /translate 200" in log.read_text()  # the access log an operator reads
        every_client_translates(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.parametrize("name, args, says", [
    ("a=b", [], "error: MODEL_NAME 'a=b': the name the model is served as"),
    ("", [], "error: MODEL_NAME '': the name"),
    ("de en", [], "error: MODEL_NAME 'de en': the name"),
    ("de-en", ["--threads", "1", "--port", "8001"], "error: --port: the image serves on 0.0.0.0:8000"),
    ("de-en", ["--host=127.0.0.1"], "error: --host=127.0.0.1: the image serves on 0.0.0.0:8000")])
def test_the_images_command_line_names_its_own_settings_in_errors(tmp_path, name, args, says):
    """MODEL_NAME=a=b was "model a: b=/model: no such model directory (create one with pipeline export)", and an
    empty one named --model, an option the Docker user never typed; a --port after the image name moved the
    server away from its EXPOSE and HEALTHCHECK without a word (the container then unhealthy)."""
    command, env = entrypoint()
    environ = {**os.environ, **env, "MODEL_NAME": name, "PATH": f"{tmp_path}:{os.environ.get('PATH', '')}"}
    (tmp_path / "pipeline").write_text("#!/bin/sh\necho started\n")  # what would have run instead of refusing
    (tmp_path / "pipeline").chmod(0o755)
    done = subprocess.run([*command, *args], env=environ, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.startswith(says), done
    assert done.stderr.count("\n") == 1
