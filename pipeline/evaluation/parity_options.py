"""`pipeline parity`'s options, generated into its command line from ParityOptions' fields: the source and
references, the backends and what they are compared with, the gate of each precision, and where the report and
the translations go. Also the gates themselves (Gate, DEFAULT_GATES, gate_for), which parity applies."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from model.errors import UserError
from runtime.fields import Checked, opt
from runtime.references import INT8_MAX_BLEU_DELTA
from runtime.registry import backend_names

REFERENCE = "torch"
REFERENCES = ("torch", "transformers")  # what the backends are compared with (--reference)


@dataclass(frozen=True)
class Gate:
    """Pass criteria for one precision. None disables a criterion."""

    min_identical: float | None
    max_bleu_delta: float | None


DEFAULT_GATES = {
    "fp32": Gate(min_identical=0.99, max_bleu_delta=0.1),
    "fp16": Gate(min_identical=None, max_bleu_delta=0.5),
    # int8 weights change some beams by design; published int8 cost is well under 1 BLEU.
    "int8": Gate(min_identical=None, max_bleu_delta=INT8_MAX_BLEU_DELTA),
    # fp32 over a vocabulary shortlist: a token outside a batch's candidates cannot be produced, so some
    # sentences change by design; fp16/int8 over one take the larger of this delta and their own (gate_for).
    "shortlist": Gate(min_identical=None, max_bleu_delta=0.3),
}
SHORTLISTED = "+shortlist"  # appended to the precision of a backend decoding over the shortlist


def gate_for(precision: str, gates: dict[str, Gate]) -> Gate:
    """The gate of a precision label: "fp16", or "fp16+shortlist" (the shortlist gate, with the larger
    BLEU delta of the two; None, not gated, is the larger)."""
    base = precision.removesuffix(SHORTLISTED)
    gate = gates.get(base, DEFAULT_GATES["fp32"])
    if base == precision:
        return gate
    shortlist = gates.get("shortlist", DEFAULT_GATES["shortlist"])
    if base == "fp32":
        return shortlist
    deltas = (shortlist.max_bleu_delta, gate.max_bleu_delta)
    return Gate(shortlist.min_identical, None if None in deltas else max(d for d in deltas if d is not None))


@dataclass(frozen=True)
class ParityOptions(Checked):
    """What `pipeline parity` compares and gates, besides how to load and decode (LoadOptions, DecodingOptions)
    and the languages (ServeBatchOptions)."""

    error = UserError

    src: Path | None = opt(None, "Source sentences, one per line (a file: each backend reads it again, so not stdin "
                                 "or a pipe); the PyTorch model translates them live. Without "
                                 "--src and --ref: the held-out lines recorded in MODEL_DIR at export, with their "
                                 "decoding options (needs no PyTorch).", path="any")
    ref: Path | None = opt(None, "Reference translations of --src, line-aligned.", path="any")
    backends: str = opt("torch,onnxruntime", "Comma-separated backends to compare against the PyTorch model ("
                        + ",".join(backend_names()) + ").")
    reference_engine: str = opt(REFERENCE, "What the backends are compared with: our fp32 PyTorch model, or, for a "
                                           "model made by `pipeline import`, transformers' own generate on the "
                                           "directory it was imported from (all backends, torch included, gated "
                                           "token for token; needs --src and --ref).",
                                flag="--reference", choices=REFERENCES)
    hf_dir: Path | None = opt(None, "With --reference transformers: the Hugging Face directory (default: the one the "
                                    "import recorded).", path="dir")
    min_identical: float | None = opt(DEFAULT_GATES["fp32"].min_identical,
                                      "fp32 gate: least share of sentences token-identical to PyTorch.")
    max_bleu_delta: float | None = opt(DEFAULT_GATES["fp32"].max_bleu_delta,
                                       "fp32 gate: largest |BLEU(backend) - BLEU(torch)|.")
    fp16_max_bleu_delta: float | None = opt(DEFAULT_GATES["fp16"].max_bleu_delta,
                                            "fp16 gate: largest |BLEU(backend) - BLEU(torch)|.")
    fp16_min_identical: float | None = opt(DEFAULT_GATES["fp16"].min_identical, "fp16 gate: least share of "
                                           "token-identical sentences (default: not gated).")
    int8_max_bleu_delta: float | None = opt(DEFAULT_GATES["int8"].max_bleu_delta,
                                            "int8 gate: largest |BLEU(backend) - BLEU(torch fp32)|.")
    int8_min_identical: float | None = opt(DEFAULT_GATES["int8"].min_identical, "int8 gate: least share of "
                                           "token-identical sentences (default: not gated).")
    json_out: Path | None = opt(None, "Write the report as JSON ('-': standard output, the table then on "
                                      "standard error).", flag="--json")
    save_hyps: Path | None = opt(None, "Write each backend's translation of SRC, line-aligned, to "
                                       "DIR/<backend>.<precision>.txt (what serve-batch writes with the same "
                                       "options).", path="dir", metavar="DIR")

    def gates(self) -> dict[str, Gate]:
        """The gate of each precision (the shortlist's is DEFAULT_GATES')."""
        return {"fp32": Gate(self.min_identical, self.max_bleu_delta),
                "fp16": Gate(self.fp16_min_identical, self.fp16_max_bleu_delta),
                "int8": Gate(self.int8_min_identical, self.int8_max_bleu_delta),
                "shortlist": DEFAULT_GATES["shortlist"]}

    def problems(self, name: Callable[[str], str] | None = None) -> list[str]:
        """A reference engine parity does not know, and a share of identical sentences above 1 (--min-identical 99
        meant 99%: a gate no backend could ever pass). A BLEU delta takes any number: one that nothing can pass
        (--int8-max-bleu-delta -1) fails every backend, which is how a gate is shown to reach its precision."""
        n = name or self.flag
        if self.reference_engine not in REFERENCES:
            return [f"{n('reference_engine')} {self.reference_engine!r}: choose one of {', '.join(REFERENCES)}"]
        out = [f"{n(key)} {value:g}: a share from 0 to 1 (0.99 for 99%)"
               for key in ("min_identical", "fp16_min_identical", "int8_min_identical")
               if (value := getattr(self, key)) is not None and not 0 <= value <= 1]
        if self.hf_dir is not None and self.reference_engine != "transformers":  # compared torch with torch
            out.append(f"{n('hf_dir')} is the directory {n('reference_engine')} transformers compares with; add "
                       f"{n('reference_engine')} transformers, or leave {n('hf_dir')} out")
        if self.save_hyps is not None and str(self.save_hyps) == "-":  # it made a directory named "-"
            out.append(f"{n('save_hyps')} -: give a directory (one file per backend), not standard output")
        return out
