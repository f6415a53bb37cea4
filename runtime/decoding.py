"""How to decode: one options object with the paper's defaults, written once.

Search, serve-batch, parity, bench, demo, in-training validation and every CLI option
take their defaults (and help texts) from `DecodingOptions`, so "beam 4, alpha 0.6,
max length source + 50" lives here and nowhere else (section 6.1 of the paper).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.errors import RuntimeUserError
from runtime.fields import flag, opt


class DecodingError(RuntimeUserError):
    """Decoding options that make no sense (names every bad option at once)."""


# beam search rules (runtime/search.py); "transformers-early": generate's early_stopping=True; "top-beam":
# fairseq's scores, ending a sentence once its best candidate ends (OpenNMT-py's and CTranslate2's early exit)
RULES = ("fairseq", "transformers", "transformers-early", "top-beam")
# The largest length penalty: (5 + 1024) / 6 or a length of 1024 to a power past about 100 overflows a float
# (usual values: 0.6 to 2).
MAX_ALPHA = 20.0




@dataclass(frozen=True)
class DecodingOptions:
    """Beam search settings; the defaults are the paper's (section 6.1). Validated once per batch, so its
    validate() is its own (here, on the decoding path) rather than runtime/fields.py's Checked."""

    beam_size: int = opt(4, "Beam width; 1 runs greedy search.")
    alpha: float = opt(0.6, "GNMT length penalty alpha: score = log_prob / ((5 + len) / 6) ** alpha; "
                             "0 turns length normalisation off.")
    max_len_a: float = opt(1.0, "Output length limit a in a * source_len + b (tokens, EOS excluded).")
    max_len_b: int = opt(50, "Output length limit b in a * source_len + b.")
    min_len: int = opt(0, "Least tokens to generate before EOS is allowed.")
    nbest: int = opt(1, "Hypotheses to return per sentence (at most the beam width).")
    # At most 32 sentences a batch on a CPU, as CTranslate2 batches, so long sources fill batches as short ones
    # do (benchmarks/README.md, "long-sources"); no cap on a GPU, where larger batches
    # are faster (benchmarks/README.md, the GPU table: fewer-kernels).
    batch_tokens: int = opt(8192, "Batch budget: sentences x longest source x beam, per batch.")
    batch_sentences: int = opt(32, "Most sentences in one batch; 0: no limit (none on a GPU unless given).")
    rules: str = opt("fairseq", "Beam search rules: fairseq (GNMT length penalty; a sentence ends when beam "
                                 "hypotheses have ended) or transformers (Hugging Face generate: log_prob / "
                                 "length ** alpha, the best beam ended hypotheses kept until none live can beat "
                                 "them; transformers-early: ends once beam hypotheses have ended, as "
                                 "early_stopping=True) or top-beam (fairseq's scores; a sentence ends once its "
                                 "best candidate ends, as OpenNMT and CTranslate2: fewer steps). Imported models "
                                 "default to their generate settings (their model dir says so).", choices=RULES)
    # The options the user set: those passed to the constructor (DecodingOptions(beam_size=4) sets beam_size,
    # though the paper's is 4), or what the CLI gives; `replace` adds its changes. None (given explicitly): those
    # that differ from the paper's defaults. Only the others take a model dir's own defaults (for_model): an
    # imported model's num_beams, a tuned model dir's alpha...
    explicit: frozenset[str] | None = field(default=None, compare=False, repr=False)

    def search_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of runtime.search.beam_search (everything but batching)."""
        return dict(beam_size=self.beam_size, alpha=self.alpha, max_len_a=self.max_len_a,
                    max_len_b=self.max_len_b, min_len=self.min_len, nbest=self.nbest, rules=self.rules)

    def replace(self, **changes: Any) -> DecodingOptions:
        """A copy with `changes`, which count as set (unless `explicit` is given, or is None here)."""
        if "explicit" not in changes and self.explicit is not None:
            changes["explicit"] = self.explicit | (changes.keys() & set(OPTION_NAMES))
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The options (not which of them the user set), for JSON."""
        return {name: getattr(self, name) for name in OPTION_NAMES}

    def given(self) -> frozenset[str]:
        """The options the user set: `explicit` (the CLI), else those that differ from the paper's."""
        if self.explicit is not None:
            return self.explicit
        return frozenset(name for name in OPTION_NAMES if getattr(self, name) != getattr(PAPER, name))

    def for_model(self, defaults: dict[str, Any] | None,
                  where: str = "the model dir's manifest.json") -> DecodingOptions:
        """These options with a model dir's decoding defaults (manifest.decoding) in place of every
        option the user did not set; validated. A bad default is named as `where`'s `decoding.FIELD`."""
        if not defaults:
            return self
        unknown = sorted(set(defaults) - set(OPTION_NAMES))
        if unknown:
            raise DecodingError(f"{where}: decoding names unknown options: {', '.join(unknown)}")
        fixed = self.given()
        changes = {k: v for k, v in defaults.items() if k not in fixed}
        if not changes:
            return self
        mistyped = [f"{where}: decoding.{k} is {v!r}, not {_KINDS[k][1]}" for k, v in changes.items()
                    if isinstance(v, bool) or not isinstance(v, _KINDS[k][0])]
        if mistyped:
            raise DecodingError("; ".join(mistyped))
        # a bad value the model dir gave is the model dir's, not an option the user never typed
        return dataclasses.replace(self, **changes, explicit=frozenset(OPTION_NAMES)).validate(
            lambda k: f"{where}: decoding.{k}" if k in changes else flag(k))

    def for_device(self, device: Any) -> DecodingOptions:
        """These options for a backend on `device`: on a GPU batches hold as many sentences as the token
        budget allows unless the user set --batch-sentences (a GPU's step costs about the same for 32
        sentences as for 128, so larger batches are faster there; on a CPU they only cost memory and
        cache traffic)."""
        if not str(device).startswith("cuda") or "batch_sentences" in self.given() or not self.batch_sentences:
            return self
        return dataclasses.replace(self, batch_sentences=0)

    def problems(self, name: Callable[[str], str] | None = None) -> list[str]:
        """Every impossible setting, each naming its field as `name` phrases it: the CLI's flag by default
        (`--beam-size`); the HTTP layer passes its JSON field names."""
        n = name or flag
        mistyped = [f"{n(k)} must be {what} (got {said(getattr(self, k))})" for k, (kinds, what) in _KINDS.items()
                    if isinstance(getattr(self, k), bool) or not isinstance(getattr(self, k), kinds)]
        if mistyped:  # (a str or a float where an int belongs failed deep in the search, or was taken)
            return mistyped
        out = []
        if self.beam_size < 1:
            out.append(f"{n('beam_size')} must be at least 1 (got {said(self.beam_size)})")
        if not 1 <= self.nbest <= max(self.beam_size, 1):
            out.append(f"{n('nbest')} must be between 1 and the beam width, {n('beam_size')} = "
                       f"{said(self.beam_size)} (got {said(self.nbest)})")
        if not (math.isfinite(self.alpha) and 0 <= self.alpha <= MAX_ALPHA):  # past it the penalty overflows
            out.append(f"{n('alpha')} must be a number from 0 to {MAX_ALPHA:g} (got {self.alpha})")
        if not math.isfinite(self.max_len_a) or self.max_len_a < 0:
            out.append(f"{n('max_len_a')} must be a finite number >= 0 (got {self.max_len_a})")
        if self.max_len_b < 0:
            out.append(f"{n('max_len_b')} must be >= 0 (got {said(self.max_len_b)})")
        if self.max_len_a == 0 and self.max_len_b == 0:
            out.append(f"{n('max_len_a')} 0 with {n('max_len_b')} 0 allows no output token at all")
        if self.min_len < 0:
            out.append(f"{n('min_len')} must be >= 0 (got {said(self.min_len)})")
        elif self.max_len_a == 0 and self.min_len > self.max_len_b:
            out.append(f"{n('min_len')} {said(self.min_len)} is above the maximum output length {self.max_len_b}")
        if self.batch_tokens < 1:
            out.append(f"{n('batch_tokens')} must be at least 1 (got {said(self.batch_tokens)})")
        if self.batch_sentences < 0:
            out.append(f"{n('batch_sentences')} must be >= 0, 0 for no limit (got {said(self.batch_sentences)})")
        if self.rules not in RULES:
            out.append(f"{n('rules')} must be one of {', '.join(RULES)} (got {self.rules!r})")
        return out

    def validate(self, name: Callable[[str], str] | None = None) -> DecodingOptions:
        """self, or a DecodingError listing every problem (fields named as in problems())."""
        problems = self.problems(name)
        if problems:
            raise DecodingError("; ".join(problems))
        return self

    @classmethod
    def help(cls, name: str) -> str:
        """The help text of one option (for the CLI)."""
        return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(DecodingOptions) if "help" in f.metadata)  # in order
# the JSON types a model dir's own decoding defaults (manifest.json's "decoding") may take, per field
_KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    f.name: (((numbers.Real,), "a number") if f.type == "float" else ((numbers.Integral,), "an integer")
             if f.type == "int" else ((str,), "a string"))  # (numpy's numbers too)
    for f in dataclasses.fields(DecodingOptions) if "help" in f.metadata}
_generated_init = DecodingOptions.__init__


def _init(self: DecodingOptions, *args: Any, **kwargs: Any) -> None:
    """The dataclass' __init__, noting what the caller passed as `explicit` (dataclasses.replace passes explicit
    itself, and keeps it)."""
    _generated_init(self, *args, **kwargs)
    if "explicit" not in kwargs and len(args) <= len(OPTION_NAMES):
        object.__setattr__(self, "explicit", frozenset(OPTION_NAMES[:len(args)]) | (kwargs.keys() & set(OPTION_NAMES)))


DecodingOptions.__init__ = _init  # type: ignore[method-assign]
PAPER = DecodingOptions()  # none set: PAPER.replace(beam_size=4) sets the beam, as DecodingOptions(beam_size=4)


def said(value: object) -> str:
    """A value as a refusal quotes it: a number of 4,000 digits (JSON has no limit) is not echoed whole."""
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 24 else f"{text[:20]}... ({len(text)} characters)"
