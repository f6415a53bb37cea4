"""Shared fixtures: tiny corpora, tokenizers, checkpoints and model dirs made in tmp, never downloaded.

Every heavy artifact is built once per session, on first use, and shared read-only: a test that
changes one works on its own copy (shutil.copytree into tmp_path). Each shared model dir is checked
against its manifest's hashes at the end of the session, so a test that wrote into one fails there.
A second process builds, on the other core, the artifacts that later tests of the session will ask
for (helpers.Artifacts; PIPELINE_TESTS_ONE_PROCESS=1 builds everything here, when asked for).
Helpers and constants live in helpers.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import ARTIFACTS, Artifacts, make_parallel


def shared(path: Path) -> Iterator[Path]:
    """The end of a session fixture of a model dir: hand `path` out, then check that no test changed
    it (read_manifest verifies every listed file's SHA-256; nothing added or removed either)."""
    from model.manifest import read_manifest

    names = sorted(p.name for p in path.iterdir())
    yield path
    read_manifest(path, verify=True)
    assert sorted(p.name for p in path.iterdir()) == names, f"a test changed the shared model dir {path}"


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_heard() -> Iterator[None]:
    """A suite started in the background (`nohup pytest &`, a script's `&`) inherits SIGINT ignored, and every
    process it starts does too: the tests of Ctrl-C then failed (9 of them), though nothing was wrong. Python's
    own handler for the session: the processes it starts get SIGINT as usual (exec resets a caught signal)."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(scope="session", autouse=True)
def ort_graph_cache(tmp_path_factory) -> Iterator[Path]:
    """ONNX Runtime's optimised graphs (runtime/graph_cache.py) go to the session's tmp, not the user's
    ~/.cache; every process of the session (the artifact helper, CLI subprocesses) shares it."""
    from runtime.graph_cache import CACHE_ENV

    root = tmp_path_factory.mktemp("ort-graphs")
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(root)
    yield root
    if before is None:
        del os.environ[CACHE_ENV]
    else:
        os.environ[CACHE_ENV] = before


@pytest.fixture(scope="session", autouse=True)
def artifacts(request, tmp_path_factory, ort_graph_cache) -> Iterator[Artifacts]:
    """Where the session's heavy artifacts are built; a second process starts on those the selected
    tests use (in the order they first do), so that the first test to need one rarely waits long."""
    wanted = list(dict.fromkeys(name for item in request.session.items for name in item.fixturenames
                                if name in ARTIFACTS))
    arts = Artifacts(tmp_path_factory.mktemp("artifacts"))
    arts.start_helper(wanted)
    yield arts
    arts.stop_helper()


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread_for_the_session() -> None:
    """torch runs on one thread in this process: tiny models run fastest so on CI's two shared cores,
    and the session fixtures below are built alike whichever test asks for them first."""
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """... and again after each test: an in-process CLI call with --threads N sets the process's
    count, which would otherwise carry over to the tests after it (their speed and last bits)."""
    yield
    torch.set_num_threads(1)


# -- tokenizer and an untrained model (helpers.ARTIFACTS says how each artifact is made) -------------

@pytest.fixture(scope="session")
def tiny_corpus() -> tuple[list[str], list[str]]:
    return make_parallel(200)


@pytest.fixture(scope="session")
def spm_bytes(artifacts) -> bytes:
    """A SentencePiece model (vocabulary 64) of tiny_corpus."""
    return artifacts.get("spm_bytes").read_bytes()


@pytest.fixture(scope="session")
def random_checkpoint(artifacts) -> Path:
    """A tiny untrained model saved as a checkpoint file (for export/runtime mechanics)."""
    return artifacts.get("random_checkpoint")


# -- the random checkpoint exported, one dir per precision / flavour (helpers.SMALL_LIMITS) --------

@pytest.fixture(scope="session")
def fp32_dir(artifacts) -> Iterator[Path]:
    """fp32, --no-tensorrt (so the manifest says why no engines, whatever the machine)."""
    yield from shared(artifacts.get("fp32_dir"))


@pytest.fixture(scope="session")
def fp16_dir(artifacts) -> Iterator[Path]:
    """fp16, TensorRT engines where TensorRT and a GPU are (the default), skipped otherwise."""
    yield from shared(artifacts.get("fp16_dir"))


@pytest.fixture(scope="session")
def int8_dir(artifacts) -> Iterator[Path]:
    """int8, the QDQ flavour (the one TensorRT parses), no engines."""
    yield from shared(artifacts.get("int8_dir"))


@pytest.fixture(scope="session")
def rowwise_dir(artifacts) -> Iterator[Path]:
    """int8 in the flavour chosen by default where no TensorRT engines are built (rowwise)."""
    yield from shared(artifacts.get("rowwise_dir"))


@pytest.fixture(scope="session")
def ort_dynamic_flavour_dir(artifacts) -> Iterator[Path]:
    """int8, --int8-flavour ort-dynamic (ONNX Runtime only)."""
    yield from shared(artifacts.get("ort_dynamic_flavour_dir"))


@pytest.fixture(scope="session")
def rowwise_flavour_dir(artifacts) -> Iterator[Path]:
    """int8, --int8-flavour rowwise asked for by name (rowwise_dir has it by default)."""
    yield from shared(artifacts.get("rowwise_flavour_dir"))


# -- a tiny model that learnt the toy task (helpers.train_tiny: seconds), and its export -----------

@pytest.fixture(scope="session")
def trained_checkpoint(artifacts) -> Path:
    return artifacts.get("trained_checkpoint")


@pytest.fixture(scope="session")
def trained_model_dir(artifacts) -> Iterator[Path]:
    """The trained tiny model exported fp32 (helpers.TRAINED_LIMITS), no engines."""
    yield from shared(artifacts.get("trained_model_dir"))


# -- a tiny model trained by the real training loop until it memorised its corpus ------------------

@pytest.fixture(scope="session")
def memorise_corpus(artifacts) -> tuple[Path, Path]:
    """A tiny made-up corpus (word-for-word translation with reversal) as train.src / train.tgt."""
    corpus = artifacts.get("memorise_corpus")
    return corpus / "train.src", corpus / "train.tgt"


@pytest.fixture(scope="session")
def trained_save_dir(artifacts) -> Path:
    """A save dir where the real `pipeline.training.train` trained the `tiny` preset on
    memorise_corpus until it translates its training sentences (helpers._trained_save_dir)."""
    return artifacts.get("trained_save_dir")


# trained_save_dir exported without engines (helpers.MEMORISED_LIMITS). Verification's bound is tested in
# test_int8.py (helpers.INT8_LOOSE_ATOL says why it is loose for int8 here); the parity gate of
# test_parity_bench.py judges the int8 model by its translations.

@pytest.fixture(scope="session")
def memorised_shortlist_fp32_dir(artifacts) -> Iterator[Path]:
    """The memorised model exported fp32 with a vocabulary shortlist counted on its corpus."""
    yield from shared(artifacts.get("memorised_shortlist_fp32_dir"))


@pytest.fixture(scope="session")
def memorised_shortlist_int8_dir(artifacts) -> Iterator[Path]:
    """The memorised model exported int8 (rowwise) with a vocabulary shortlist counted on its corpus."""
    yield from shared(artifacts.get("memorised_shortlist_int8_dir"))


@pytest.fixture(scope="session")
def memorised_fp32_dir(artifacts) -> Iterator[Path]:
    yield from shared(artifacts.get("memorised_fp32_dir"))


@pytest.fixture(scope="session")
def memorised_fp16_dir(artifacts) -> Iterator[Path]:
    yield from shared(artifacts.get("memorised_fp16_dir"))


@pytest.fixture(scope="session")
def memorised_int8_dir(artifacts) -> Iterator[Path]:
    """int8 in the default flavour without engines: rowwise."""
    yield from shared(artifacts.get("memorised_int8_dir"))


@pytest.fixture(scope="session")
def memorised_qdq_dir(artifacts) -> Iterator[Path]:
    """int8, the QDQ flavour."""
    yield from shared(artifacts.get("memorised_qdq_dir"))
