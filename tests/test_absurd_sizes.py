"""Sizes typed with too many digits are refused in one line before anything is allocated or drawn: a model of
more than MAX_PARAMETERS weights (train, random-checkpoint), a vocabulary past MAX_VOCAB, a seed outside
0..2^32-1, bench's --src-len past the model's limit. They were tracebacks (torch's allocator, numpy's seed) or
ran for ever."""

from __future__ import annotations

import pytest
from helpers import run_cli_captured

from model.config import MAX_PARAMETERS, MAX_VOCAB, ConfigError, preset


def test_a_model_config_past_max_parameters_is_refused_before_allocating():
    assert preset("base", vocab_size=32000).approx_parameters() < MAX_PARAMETERS
    for sizes in (dict(d_model=10 ** 12), dict(d_ff=10 ** 12), dict(n_dec_layers=10 ** 12),
                  dict(vocab_size=10 ** 12)):
        with pytest.raises(ConfigError, match=r"parameters \(vocab_size .*\), more than MAX_PARAMETERS"):
            preset("tiny", **{"vocab_size": 1000, **sizes})


@pytest.mark.parametrize("args, says", [
    (("train", "--save-dir", "{tmp}/run", "--preset", "tiny", "--d-model", 10 ** 12), "more than MAX_PARAMETERS"),
    (("train", "--save-dir", "{tmp}/run", "--vocab-size", 10 ** 12), f"--vocab-size must be in 8..{MAX_VOCAB}"),
    (("random-checkpoint", "{tmp}/r.pt", "--preset", "tiny", "--vocab-size", 10 ** 12), "--vocab-size"),
    (("random-checkpoint", "{tmp}/r.pt", "--preset", "tiny", "--seed", 10 ** 21), "--seed"),
    (("random-checkpoint", "{tmp}/r.pt", "--preset", "tiny", "--decoder-layers", 10 ** 12), "MAX_PARAMETERS"),
])
def test_absurd_sizes_are_one_line(capsys, tmp_path, args, says):
    code, _, err = run_cli_captured(capsys, *(str(a).format(tmp=tmp_path) for a in args))
    assert code == 2 and says in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_bench_src_len_past_the_model_limit(capsys, fp32_dir):
    code, _, err = run_cli_captured(capsys, "bench", fp32_dir, "--sentences", 2, "--src-len", 10 ** 12)
    assert code == 2 and "--src-len 1000000000000 is longer than the model's source limit" in err, err


def test_a_random_checkpoint_past_this_machines_memory_is_one_line_before_sentencepiece(capsys, tmp_path,
                                                                                        monkeypatch):
    """`--preset base --decoder-layers 3000` (1.3e10 weights, 50 GB) is under MAX_PARAMETERS: it allocated until the
    OOM killer came (or a traceback), after SentencePiece had trained on made-up text."""
    from pipeline.evaluation import random_model

    monkeypatch.setattr(random_model, "available_memory", lambda: 8 << 30)
    monkeypatch.setattr(random_model, "train_sentencepiece", lambda *a: pytest.fail("SentencePiece trained first"))
    code, _, err = run_cli_captured(capsys, "random-checkpoint", tmp_path / "r.pt", "--decoder-layers", 3000)
    assert code == 2 and "more than the 8.6 GB of memory available" in err and "Traceback" not in err, err
    assert "GB to build and save in fp32" in err
    assert list(tmp_path.iterdir()) == []
