"""The decoding contract: the paper's defaults in one place, every bad option named."""

from __future__ import annotations

import math

import pytest

from runtime.decoding import PAPER, DecodingError, DecodingOptions


def test_paper_defaults():
    assert (PAPER.beam_size, PAPER.alpha, PAPER.max_len_a, PAPER.max_len_b) == (4, 0.6, 1.0, 50)
    assert PAPER.search_kwargs()["beam_size"] == 4
    assert "length penalty" in DecodingOptions.help("alpha")


@pytest.mark.parametrize("changes, option", [
    (dict(beam_size=0), "--beam-size"),
    (dict(nbest=5), "--nbest"),
    (dict(alpha=math.nan), "--alpha"),
    (dict(alpha=-1.0), "--alpha"),
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
