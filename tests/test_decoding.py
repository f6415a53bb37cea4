"""The decoding contract: the paper's defaults in one place, every bad option named."""

from __future__ import annotations

import math

import click
import pytest
from helpers import run_cli

from model.config import EOS_ID
from pipeline.cli_options import parse_backends
from runtime.decoding import PAPER, DecodingError, DecodingOptions
from runtime.errors import RuntimeUserError
from runtime.registry import backend_names
from runtime.tokenizer import Tokenizer
from runtime.translate import encode_sources


def test_paper_defaults():
    assert (PAPER.beam_size, PAPER.alpha, PAPER.max_len_a, PAPER.max_len_b) == (4, 0.6, 1.0, 50)
    assert PAPER.search_kwargs()["beam_size"] == 4
    assert "length penalty" in DecodingOptions.help("alpha")


@pytest.mark.parametrize("changes, option", [
    (dict(beam_size=0), "--beam-size"),
    (dict(nbest=5), "--nbest"),
    (dict(alpha=math.nan), "--alpha"),
    (dict(alpha=-1.0), "--alpha"),
    (dict(alpha=1e308), "--alpha must be a number from 0 to 20"),  # overflowed in the length penalty
    (dict(max_len_a=-1.0), "--max-len-a"),
    (dict(max_len_b=-3), "--max-len-b"),
    (dict(max_len_a=0.0, max_len_b=0), "--max-len-a 0 with --max-len-b 0"),
    (dict(max_len_a=0.0, max_len_b=5, min_len=9), "--min-len 9"),
    (dict(batch_tokens=0), "--batch-tokens"),
])
def test_bad_options_are_named(changes, option):
    with pytest.raises(DecodingError, match=option):
        PAPER.replace(**changes).validate()


def test_all_problems_reported_at_once():
    with pytest.raises(DecodingError) as e:
        PAPER.replace(beam_size=0, alpha=math.inf).validate()
    assert "--beam-size" in str(e.value) and "--alpha" in str(e.value)


COMMANDS = {
    "serve-batch": ["no-model-dir", "in.txt", "-o", "out.txt"],
    "parity": ["no-model-dir", "--src", "src.txt", "--ref", "ref.txt"],
    "bench": ["no-model-dir"],
    "demo": ["--out", "no-demo-dir"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_takes_decoding_defaults_and_validation_from_the_contract(command, capsys, tmp_path,
                                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_cli(command, "--help") == 0
    help_text = " ".join(capsys.readouterr().out.split())
    # a command that decodes a model dir says the model dir's own default comes first (an import's num_beams)
    assert f"{DecodingOptions.help('beam_size')} [default: {PAPER.beam_size}]" in help_text or \
        f"{DecodingOptions.help('beam_size')} [default: (the model dir's, else {PAPER.beam_size})]" in help_text
    # Validated before any work: one line naming the option, nothing created.
    assert run_cli(command, *COMMANDS[command], "--beam-size", 0) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["error: --beam-size must be at least 1 (got 0)"]
    assert list(tmp_path.iterdir()) == []


def test_serve_and_parity_share_the_search_options(capsys):
    for command in ("serve-batch", "parity"):
        assert run_cli(command, "--help") == 0
        help_text = " ".join(capsys.readouterr().out.split())
        for name in ("alpha", "max_len_a", "max_len_b", "min_len", "batch_tokens"):
            assert f"--{name.replace('_', '-')}" in help_text and DecodingOptions.help(name) in help_text
    assert run_cli("serve-batch", *COMMANDS["serve-batch"], "--nbest", 5, "--alpha", 30) == 2
    err = capsys.readouterr().err
    assert "--nbest must be between 1 and the beam width, --beam-size = 4" in err and "--alpha must be" in err
    for command, option in (("serve-batch", "--alpha"), ("parity", "--min-identical"), ("parity", "--max-bleu-delta")):
        for value in ("nan", "inf", "-inf"):  # every float option, as it is typed (a NaN gate passed everything)
            assert run_cli(command, *COMMANDS[command], option, value) == 2
            err = capsys.readouterr().err  # one `error:` line, as the project's own refusals (click printed four)
            assert err == f"error: Invalid value for '{option}': '{value}' is not a finite number (see `pipeline " \
                          f"{command} --help`)\n"
    for option in ("--min-identical", "--int8-min-identical"):  # a percent typo: a gate nothing could pass
        assert run_cli("parity", *COMMANDS["parity"], option, 99) == 2
        assert f"{option} 99: a share from 0 to 1 (0.99 for 99%)" in capsys.readouterr().err
    assert run_cli("serve", "no-model-dir", "--body-timeout-s", "nan") == 2  # it answered every request 503
    assert "'nan' is not a finite number" in capsys.readouterr().err
    assert run_cli("export", "no.pt", "--out", "no-dir", "--atol", "nan") == 2  # after the whole export, before
    assert "'nan' is not a finite number" in capsys.readouterr().err


def test_parse_backends_uses_the_loader_registry():
    assert parse_backends(" torch,onnxruntime ") == ["torch", "onnxruntime"]
    assert set(backend_names()) == {"torch", "onnxruntime", "tensorrt"}
    with pytest.raises(click.BadParameter, match="choose from torch, onnxruntime, tensorrt"):
        parse_backends("torch,auto")


def test_encode_sources_is_the_one_line_policy(spm_bytes):
    tok = Tokenizer(spm_bytes)
    long_line = " ".join(["der hund sieht die katze"] * 6)
    full = tok.encode_source([long_line])[0]
    limit = len(full) - 3
    out = encode_sources(tok, ["der hund", "", " \t ", long_line], limit)
    assert out.ids[0] == tok.encode_source(["der hund"])[0] and out.ids[0][-1] == EOS_ID
    assert out.ids[1] == out.ids[2] == []
    assert out.ids[3] == full[: limit - 1] + [EOS_ID] and len(out.ids[3]) == limit
    assert (out.empty, out.truncated) == (2, 1)
    with pytest.raises(RuntimeUserError, match=f"in.txt:13: {len(full)} tokens, more than the model's limit"):
        encode_sources(tok, ["der hund", "", " \t ", long_line], limit, long_lines="error", origin="in.txt",
                       first_line=10)
    assert encode_sources(tok, ["", "  "], limit).ids == [[], []]


def test_a_gpu_batches_more_unless_told():
    """serve-batch's batches on a GPU (DecodingOptions.for_device): no sentence cap unless --batch-sentences
    was given; a CPU keeps the default cap."""
    assert PAPER.batch_sentences == 32 and PAPER.batch_tokens == 8192
    assert PAPER.for_device("cpu") == PAPER
    for device in ("cuda", "cuda:1"):
        assert PAPER.for_device(device).batch_sentences == 0
        assert PAPER.for_device(device).batch_tokens == PAPER.batch_tokens
    given = PAPER.replace(explicit=frozenset({"batch_sentences"}))  # --batch-sentences 32 typed out
    assert given.for_device("cuda").batch_sentences == 32
    other = PAPER.replace(explicit=frozenset({"beam_size"}), beam_size=5)
    assert other.for_device("cuda").replace(explicit=None) == PAPER.replace(beam_size=5, batch_sentences=0)
    assert PAPER.replace(batch_sentences=8).for_device("cuda").batch_sentences == 8  # from Python, not default
    assert PAPER.replace(batch_sentences=-1).problems() == ["--batch-sentences must be >= 0, 0 for no limit (got -1)"]


def test_batches_hold_at_most_batch_sentences(fp32_dir):
    """translate_ids cuts batches at options.batch_sentences (or the backend's max_batch, whichever is
    smaller) whatever the token budget allows; 0 lifts the cap; the translations are the same."""
    from runtime.model_dir import LoadOptions, load
    from runtime.translate import length_batches, translate_ids

    assert [len(b) for b in length_batches([5] * 70, 8192, 4, 32)] == [32, 32, 6]
    assert [len(b) for b in length_batches([56] * 40, 2048, 4, 32)] == [9, 9, 9, 9, 4]  # the budget binds first
    loaded = load(fp32_dir, LoadOptions(backend="torch"))
    backend, sizes = loaded.backend, []
    encode = backend.encode

    def counted(src, *args, **kwargs):
        sizes.append(len(src))
        return encode(src, *args, **kwargs)

    backend.encode = counted  # type: ignore[method-assign]
    ids = loaded.tokenizer.encode([f"ein hund {'und ' * (i % 4)}eine katze" for i in range(11)])
    sources = [s[: backend.max_src_len - 1] + [EOS_ID] for s in ids]
    capped = translate_ids(backend, sources, PAPER.replace(batch_sentences=3), max_len_b=4, max_len_a=0)
    assert sizes == [3, 3, 3, 2]
    sizes.clear()
    free = translate_ids(backend, sources, PAPER.replace(batch_sentences=0), max_len_b=4, max_len_a=0)
    assert sizes == [min(11, backend.max_batch or 11)]
    assert [[h.tokens for h in hyps] for hyps in capped] == [[h.tokens for h in hyps] for hyps in free]


def test_problems_name_fields_as_the_caller_phrases_them():
    bad = PAPER.replace(beam_size=0, nbest=2)
    assert bad.problems()[0] == "--beam-size must be at least 1 (got 0)"
    assert bad.problems(name=str) == ["beam_size must be at least 1 (got 0)",
                                      "nbest must be between 1 and the beam width, beam_size = 0 (got 2)"]


@pytest.mark.parametrize("defaults, says", [
    ({"beam_size": 0}, "M: decoding.beam_size must be at least 1 (got 0)"),  # was blamed on --beam-size
    ({"beam_size": "4"}, "M: decoding.beam_size is '4', not an integer"),  # was a TypeError
    ({"alpha": True}, "M: decoding.alpha is True, not a number"),
    ({"rules": 3}, "M: decoding.rules is 3, not a string"),
    ({"beams": 4}, "M: decoding names unknown options: beams"),
])
def test_a_model_dirs_bad_decoding_defaults_are_named_as_its_own(defaults, says):
    with pytest.raises(DecodingError) as e:
        PAPER.for_model(defaults, "M")
    assert str(e.value) == says and "--" not in str(e.value)


def test_an_option_the_user_gave_is_named_as_such_beside_a_model_default():
    given = PAPER.replace(nbest=3, explicit=frozenset({"nbest"}))
    says = r"^--nbest must be between 1 and the beam width, M: decoding.beam_size = 2 "
    with pytest.raises(DecodingError, match=says):
        given.for_model({"beam_size": 2}, "M")
    assert given.for_model({"nbest": 0}, "M").nbest == 3  # the user's option wins; the default it replaces is unused
    with pytest.raises(DecodingError, match=r"^--beam-size must be at least 1 \(got 0\)$"):
        PAPER.replace(beam_size=0, explicit=frozenset({"beam_size"})).for_model({"alpha": 1}, "M")


def test_a_model_dir_with_a_bad_decoding_default_is_one_line_naming_its_manifest(fp32_dir, tmp_path, capsys):
    import json
    import shutil
    model = tmp_path / "model"
    shutil.copytree(fp32_dir, model)
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["decoding"] = {"beam_size": "4"}
    (model / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "in.txt").write_text("hello\n")
    assert run_cli("serve-batch", model, tmp_path / "in.txt", "-o", tmp_path / "out.txt") == 2
    err = capsys.readouterr().err
    assert f"error: {model / 'manifest.json'}: decoding.beam_size is '4', not an integer" in err
    assert "Traceback" not in err and not (tmp_path / "out.txt").exists()


def test_options_passed_from_python_beat_a_model_dir_s_defaults_even_at_the_paper_s_values():
    """Translator(M, decoding=DecodingOptions(beam_size=4, alpha=0.6)) on a model dir recording beam 1, alpha 1.0
    decoded with beam 1, alpha 1.0 (only values unlike the paper's counted as given; the CLI marked its own), and
    nbest=2 beside beam_size=4 was refused against the model's beam 1."""
    import dataclasses
    import pickle

    model = {"beam_size": 1, "alpha": 1.0}
    both = DecodingOptions(beam_size=4, alpha=0.6).for_model(model, "M")
    assert (both.beam_size, both.alpha) == (4, 0.6)
    beam = DecodingOptions(beam_size=4, nbest=2).for_model(model, "M")
    assert (beam.beam_size, beam.nbest, beam.alpha) == (4, 2, 1.0)  # alpha not passed: the model's
    assert DecodingOptions(4).for_model(model, "M").beam_size == 4  # positional too
    none = DecodingOptions().for_model(model, "M")
    assert (none.beam_size, none.alpha) == (1, 1.0)
    later = DecodingOptions(beam_size=3).replace(alpha=0.6)  # replace's changes are set too
    assert later.for_model(model, "M").alpha == 0.6 and later.given() == {"beam_size", "alpha"}
    assert PAPER.replace(beam_size=4, alpha=0.6).for_model(model, "M").beam_size == 4  # PAPER's replace sets too
    assert PAPER.for_model(model, "M").beam_size == 1
    kept = dataclasses.replace(DecodingOptions(alpha=0.6), beam_size=5)  # dataclasses.replace keeps what was set
    assert kept.given() == {"alpha"} and pickle.loads(pickle.dumps(kept)).given() == {"alpha"}


@pytest.mark.parametrize("changes, says", [
    ({"beam_size": "4"}, "--beam-size must be an integer (got '4')"),
    ({"beam_size": 2.5}, "--beam-size must be an integer (got 2.5)"),
    ({"beam_size": True}, "--beam-size must be an integer (got True)"),
    ({"alpha": "0.6"}, "--alpha must be a number (got '0.6')"),
    ({"alpha": None}, "--alpha must be a number (got None)"),
    ({"batch_sentences": None}, "--batch-sentences must be an integer (got None)"),
    ({"rules": 3}, "--rules must be a string (got 3)"),
])
def test_a_value_of_the_wrong_type_is_named_not_a_deep_type_error(changes, says):
    """DecodingOptions(beam_size="4") failed with "'<' not supported" in problems(), 2.5 deep in numpy."""
    import numpy as np

    with pytest.raises(DecodingError) as e:
        DecodingOptions(**changes).validate()
    assert str(e.value) == says
    DecodingOptions(beam_size=np.int64(4), alpha=np.float32(0.6)).validate()  # numpy's numbers are numbers
