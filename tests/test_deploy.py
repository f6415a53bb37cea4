"""The deploy path without PyTorch: serve-batch, serve, parity against the references recorded at
export, bench and doctor on an exported model dir, in processes where `import torch` fails.

In the main environment each command runs in a subprocess with torch blocked (sys.modules['torch']
= None, so any import of it raises); CI also runs this file in a second virtualenv that has only
`pip install -e ".[deploy]"` (no torch at all), on a model dir the main environment exported
(PIPELINE_DEPLOY_MODEL_DIR). Self-contained: it uses no conftest fixture, so that venv can run it
with --noconftest."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

# Every test here exports a model or spawns the CLI / a server: the slow tier.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BLOCK_TORCH = "import sys; sys.modules['torch'] = None\n"
LINES = ["ab cd", "", "ef gh ij", "kl", "mn op qr st"]


def run_blocked(*args: object, timeout: float = 300) -> subprocess.CompletedProcess:
    """`pipeline ARGS` in a fresh process where importing torch fails; afterwards the process asserts
    that no torch module was imported at all."""
    code = (BLOCK_TORCH + "from pipeline.cli import main\n"
            f"try:\n    main({[str(a) for a in args]!r})\n"
            "finally:\n"
            "    loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' and sys.modules[m] is not None)\n"
            "    assert not loaded, f'torch imported: {loaded}'\n")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """An exported model dir with recorded references: CI's, or one exported here (needs torch)."""
    given = os.environ.get("PIPELINE_DEPLOY_MODEL_DIR")
    if given:
        return Path(given)
    pytest.importorskip("torch")
    from export.api import export_model
    from pipeline.evaluation.random_model import make_random_checkpoint

    tmp = tmp_path_factory.mktemp("deploy")
    make_random_checkpoint(tmp / "r.pt", "tiny", 120, seed=1)
    sources = [f"{w} {w}{i} x{i}" for i, w in enumerate(["ab", "cd", "ef", "gh", "ij"] * 2)]
    export_model(tmp / "r.pt", tmp / "model", tensorrt=False, max_src_len=32, max_tgt_len=40,
                 references=(sources, [s.upper() for s in sources]), shortlist=shortlist_corpus())
    return tmp / "model"


def shortlist_corpus():
    """The made-up parallel corpus scripts/deploy_check.sh counts its model's shortlist on."""
    import random

    from export.shortlist import ShortlistCorpus

    rng = random.Random(0)
    vocab = ["".join(rng.choices("abcdefghijklmnop", k=rng.randint(2, 6))) for _ in range(80)]
    pairs = [rng.sample(range(80), 4) for _ in range(300)]
    src = [" ".join(vocab[i] for i in p) for p in pairs]
    tgt = [" ".join(vocab[(i + 7) % 80] for i in reversed(p)) for p in pairs]
    return ShortlistCorpus(src, tgt, ("corpus.src", "corpus.tgt"))


@pytest.fixture(scope="module")
def served_file(model_dir, tmp_path_factory) -> tuple[Path, list[str]]:
    """serve-batch's output for LINES, made without torch."""
    tmp = tmp_path_factory.mktemp("deploy-io")
    src, out = tmp / "in.txt", tmp / "out.txt"
    src.write_text("".join(line + "\n" for line in LINES), encoding="utf-8")
    done = run_blocked("serve-batch", model_dir, src, "-o", out, "--backend", "onnxruntime", "--no-progress",
                       "--threads", "1")
    assert done.returncode == 0, done.stderr
    return src, out.read_text(encoding="utf-8").split("\n")[:-1]


def test_deploy_modules_import_without_torch():
    """Everything the deploy commands load, imported with torch blocked."""
    modules = ["pipeline.cli", "pipeline.commands.serve_batch", "pipeline.commands.serve", "pipeline.commands.parity",
               "pipeline.commands.bench", "pipeline.commands.doctor", "pipeline.serve.options",
               "pipeline.serve_batch.files", "runtime.sentences", "pipeline.evaluation.parity",
               "pipeline.evaluation.bench",
               "pipeline.evaluation.bench_compare", "pipeline.environment", "runtime.ort_backend",
               "runtime.search", "runtime.translate", "runtime.references", "model", "model.cache", "model.manifest"]
    code = BLOCK_TORCH + "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_serve_batch_without_torch(model_dir, served_file):
    """Line-aligned output, each line what the runtime's own translate_lines gives for it."""
    from runtime.model_dir import LoadOptions, load
    from runtime.translate import translate_lines

    _, lines = served_file
    assert len(lines) == len(LINES)
    assert lines[1] == ""  # a blank line stays blank, in its place
    loaded = load(model_dir, LoadOptions(backend="onnxruntime", threads=1))
    backend, tokenizer = loaded.backend, loaded.tokenizer
    assert lines == translate_lines(backend, tokenizer, LINES)


def test_parity_against_recorded_references_without_torch(model_dir, tmp_path):
    report = tmp_path / "parity.json"
    done = run_blocked("parity", model_dir, "--json", report, "--threads", "1")
    assert done.returncode == 0, done.stderr + done.stdout
    data = json.loads(report.read_text())
    assert data["passed"] and [r["backend"] for r in data["results"]] == ["onnxruntime"]
    recorded = json.loads((model_dir / "references.json").read_text())
    assert data["results"][0]["identical"] == 1.0 and data["sentences"] == len(recorded["sources"]) > 0
    assert "recorded at export" in data["src"]
    # the record's own decoding applies; choosing another needs the live model
    other = run_blocked("parity", model_dir, "--beam-size", "2")
    assert other.returncode == 2 and "recorded" in other.stderr
    live = run_blocked("parity", model_dir, "--src", ROOT / "README.md", "--ref", ROOT / "README.md")
    assert live.returncode == 2 and "needs PyTorch" in live.stderr and "Traceback" not in live.stderr


def test_shortlist_without_torch(model_dir, tmp_path):
    """serve-batch --shortlist writes what the runtime's shortlisted backend gives; parity --shortlist gates it
    against the recorded full-vocabulary translations and reports their coverage."""
    from runtime.model_dir import LoadOptions, load
    from runtime.translate import translate_lines

    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("".join(line + "\n" for line in LINES), encoding="utf-8")
    done = run_blocked("serve-batch", model_dir, src, "-o", out, "--backend", "onnxruntime", "--no-progress",
                       "--threads", "1", "--shortlist")
    assert done.returncode == 0, done.stderr
    assert "with shortlist" in done.stderr
    loaded = load(model_dir, LoadOptions(backend="onnxruntime", threads=1, shortlist=True))
    backend, tokenizer = loaded.backend, loaded.tokenizer
    assert out.read_text(encoding="utf-8").splitlines() == translate_lines(backend, tokenizer, LINES)
    report = tmp_path / "parity.json"
    done = run_blocked("parity", model_dir, "--json", report, "--threads", "1", "--shortlist")
    [result] = json.loads(report.read_text())["results"]
    assert result["precision"] == "fp32+shortlist" and 0 < result["shortlist_coverage"] <= 1, done.stderr


def test_bench_and_doctor_without_torch(model_dir, tmp_path):
    out = tmp_path / "bench.json"
    done = run_blocked("bench", model_dir, "--backends", "onnxruntime", "--batch-size", "2", "--sentences", "4",
                       "--fixed-length", "4", "--threads", "1", "--json", out)
    assert done.returncode == 0, done.stderr
    [row] = json.loads(out.read_text())["results"]
    assert row["backend"] == "onnxruntime" and row["target_tokens"] == 4 * 4
    # the default --backends (torch,onnxruntime): the exported graphs, as parity takes them (it was "the torch
    # backend needs PyTorch")
    done = run_blocked("bench", model_dir, "--batch-size", "2", "--sentences", "4", "--threads", "1", "--json", out)
    assert done.returncode == 0, done.stderr
    assert [r["backend"] for r in json.loads(out.read_text())["results"]] == ["onnxruntime"]
    doctor = run_blocked("doctor", model_dir)
    assert doctor.returncode == 0, doctor.stderr
    assert "torch         not installed" in doctor.stdout
    assert re.search(r"onnxruntime\s+\w+\s+cpu\s+yes", doctor.stdout)


@pytest.mark.parametrize("command", ["train", "export", "random-checkpoint"])
def test_torch_commands_say_which_extra_they_need(command):
    helped = run_blocked(command, "--help")
    assert helped.returncode == 0 and 'Needs PyTorch: pip install -e ".[train]"' in helped.stdout
    done = run_blocked(command, "some-path", "--out", "elsewhere")
    assert done.returncode == 2
    assert done.stderr.strip() == (f"error: `pipeline {command}` needs PyTorch, which this install does not have "
                                   '(a deploy-only install): pip install -e ".[train]"')


def test_torch_backend_asked_for_without_torch(model_dir, served_file):
    src, _ = served_file
    done = run_blocked("serve-batch", model_dir, src, "-o", "-", "--backend", "torch")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "needs PyTorch" in done.stderr and "an ONNX Runtime backend (onnxruntime)" in done.stderr
    # the GPU through PyTorch: the way out is the CPU, whatever the backend (it said --backend onnxruntime, given)
    done = run_blocked("serve-batch", model_dir, src, "-o", "-", "--backend", "onnxruntime", "--device", "cuda")
    assert done.returncode == 2 and "--device cuda needs PyTorch" in done.stderr and "use --device cpu" in done.stderr


MAX_BYTES = 100_000


def served_url(proc: subprocess.Popen, log_path: Path, timeout: float = 120) -> str:
    """The URL a starting `pipeline serve` logs ("serving ... at http://127.0.0.1:PORT"), once it accepts
    connections (the line comes when the port is bound, a moment before it listens); the log in the failure
    when it exits or takes longer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"at (http://127\.0\.0\.1:(\d+))", log_path.read_text())
        if m:
            try:
                socket.create_connection(("127.0.0.1", int(m.group(2))), timeout=1).close()
                return m.group(1)
            except OSError:
                pass
        time.sleep(0.1)
    raise AssertionError(f"the server did not start:\n{log_path.read_text()}")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """`pipeline serve` without torch on a free loopback port (--max-bytes MAX_BYTES); on teardown,
    SIGTERM must stop it with status 0, torch never imported."""
    pytest.importorskip("uvicorn")
    log_path = tmp_path_factory.mktemp("deploy-serve") / "serve.log"
    code = (BLOCK_TORCH + "from pipeline.cli import main\n"
            f"main(['serve', {str(model_dir)!r}, '--port', '0', '--backend', 'onnxruntime', '--threads', '1', "
            f"'--max-bytes', '{MAX_BYTES}'])\n"
            "assert not [m for m in sys.modules if m.split('.')[0] == 'torch' and sys.modules[m] is not None]\n")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield served_url(proc, log_path)
    finally:
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(60)
    assert status == 0, log_path.read_text()


def post(url: str, body: bytes, timeout: float = 60) -> tuple[int, dict]:
    """A plain urllib client, as users write one: (status, JSON answer), HTTP errors included."""
    request = urllib.request.Request(f"{url}/translate", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_serve_without_torch(server, served_file):
    """The HTTP service answers exactly what serve-batch wrote."""
    _, expected = served_file
    status, answer = post(server, json.dumps({"text": LINES}).encode())
    assert status == 200 and answer["translations"] == expected
    status, answer = post(server, json.dumps({"text": [" ab cd.  ef gh ij. "], "split": "sentences"}).encode())
    [document] = answer["translations"]  # sentencex, too, runs without torch
    assert status == 200 and document.startswith(" ") and "  " in document and document.endswith(" ")


@pytest.mark.parametrize("size", [MAX_BYTES + 1, 20 << 20])
def test_an_oversized_body_gets_its_413(server, size):
    """The server reads and discards the rest of the body before answering, so a client that is
    still sending receives the 413 rather than a connection reset; the server serves on."""
    filler = b"a" * (size - len(b'{"text": [""]}'))
    body = b'{"text": ["' + filler + b'"]}'
    assert len(body) == size
    status, answer = post(server, body)
    assert status == 413 and str(MAX_BYTES) in answer["error"]
    status, answer = post(server, json.dumps({"text": ["ab cd"]}).encode())
    assert status == 200 and len(answer["translations"]) == 1


# -- start-up: re-verifying a model dir hashes only what changed ------------------------------------


def _counting_hashes(monkeypatch, tmp_path) -> list[str]:
    from model import digests

    monkeypatch.setenv("PIPELINE_HASH_CACHE", str(tmp_path / "hash-cache"))
    monkeypatch.setattr(digests, "CACHED_MIN_BYTES", 1)  # the test's small files count as large
    calls: list[str] = []
    real = digests.sha256_file
    monkeypatch.setattr(digests, "sha256_file", lambda p, *a: calls.append(Path(p).name) or real(p, *a))
    return calls


def test_reverify_hashes_only_changed_files(model_dir, tmp_path, monkeypatch):
    import shutil

    from model import digests
    from model.manifest import ModelDirError, read_manifest

    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    calls = _counting_hashes(monkeypatch, tmp_path)
    monkeypatch.setattr(digests, "RACY_NS", 0)  # the copies are fresh; racy entries have their own test
    read_manifest(copy)
    assert sorted(calls) == sorted(read_manifest(copy, verify=False).files)  # the first load hashes all
    calls.clear()
    read_manifest(copy)
    assert calls == []  # unchanged files: their remembered digests

    # A same-size change with the mtime put back is still caught: the ctime moved.
    time.sleep(0.05)
    target = copy / "decoder.data"
    st = target.stat()
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert target.stat().st_mtime_ns == st.st_mtime_ns and target.stat().st_size == st.st_size
    with pytest.raises(ModelDirError, match="decoder.data: SHA-256 does not match"):
        read_manifest(copy)
    assert calls == ["decoder.data"]

    monkeypatch.setenv("PIPELINE_HASH_CACHE", "off")
    calls.clear()
    with pytest.raises(ModelDirError):
        read_manifest(copy)
    assert "decoder.data" in calls


def test_a_digest_taken_right_after_a_change_is_not_trusted(model_dir, tmp_path, monkeypatch):
    """A change within the same clock tick as the hashing keeps the file's identity, so a digest
    taken within RACY_NS of the last change is taken again next time."""
    import shutil

    from model.manifest import read_manifest

    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    calls = _counting_hashes(monkeypatch, tmp_path)
    read_manifest(copy)
    calls.clear()
    read_manifest(copy)
    assert "decoder.data" in calls  # just written: hashed again


def test_unwritable_hash_cache_still_verifies(model_dir, tmp_path, monkeypatch):
    from model.manifest import read_manifest

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("PIPELINE_HASH_CACHE", str(blocker / "cache"))
    assert read_manifest(model_dir).files


# -- references recorded at export ---------------------------------------------------------------


def test_references_record_is_covered_by_the_manifest(model_dir, tmp_path):
    import shutil

    from model.manifest import REFERENCES_FILE, ModelDirError, read_manifest

    assert REFERENCES_FILE in read_manifest(model_dir).files
    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    record = json.loads((copy / REFERENCES_FILE).read_text())
    record["lines"][0] = "a better translation"
    (copy / REFERENCES_FILE).write_text(json.dumps(record))
    with pytest.raises(ModelDirError, match=REFERENCES_FILE):
        read_manifest(copy)


def test_held_out_lines_skip_blank_pairs_and_refuse_misaligned_files(tmp_path, caplog):
    """Blank pairs are left out, counted (they were in silence), and a UTF-8 byte order mark is no text."""
    from runtime.errors import RuntimeUserError
    from runtime.references import held_out_lines

    src, tgt = tmp_path / "v.src", tmp_path / "v.tgt"
    src.write_text("a\n\nc\nd\ne\n")
    tgt.write_text("\ufeffA\nB\n\nD\nE\n")
    with caplog.at_level(logging.WARNING):
        assert held_out_lines(src, tgt, limit=2) == (["a", "d"], ["A", "D"])
    assert "2 line pair(s) with a blank side left out of the held-out lines" in caplog.text
    tgt.write_text("A\n")
    with pytest.raises(RuntimeUserError, match="line-aligned"):
        held_out_lines(src, tgt)
