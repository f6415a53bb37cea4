"""Choose the beam width and length penalty on a validation set (never a test set): translate
it with every combination through the path serve-batch and parity use (runtime.translate with
a DecodingOptions) and score each with sacreBLEU."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.errors import UserError
from model.manifest import MANIFEST
from pipeline.textio import read_lines
from runtime.backend import Backend
from runtime.decoding import PAPER, DecodingOptions
from runtime.fields import Checked, flag, opt, with_value
from runtime.languages import direction
from runtime.model_dir import LoadOptions, ModelDir, load
from runtime.tokenizer import AnyTokenizer
from runtime.translate import translate_lines

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trial:
    beam_size: int
    alpha: float
    bleu: float
    chrf: float
    # the other search settings the trial ran with (the model's own defaults under the options given), which an
    # export must record too for the model dir to decode as tuned
    max_len_a: float = PAPER.max_len_a
    max_len_b: int = PAPER.max_len_b
    min_len: int = PAPER.min_len
    rules: str = PAPER.rules

    def export_flags(self) -> str:
        """The export options that make this trial a model dir's decoding: beam and alpha, and every other
        search setting unlike the paper's."""
        return " ".join(with_value(k, v) for k in ("beam_size", "alpha", "max_len_a", "max_len_b", "min_len", "rules")
                        if (v := getattr(self, k)) != getattr(PAPER, k) or k in ("beam_size", "alpha"))


def parse_list(text: str, kind: type, option: str) -> list[Any]:
    """`1,4,6` -> [1, 4, 6]; a one-line error naming the option otherwise."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        example = "0.6,1.0" if kind is float else "1,4,6"  # --alphas 1,4,6 read as a list of beams
        raise UserError(f"{option} {text!r}: give comma-separated numbers, e.g. {example}") from None
    if not values:
        raise UserError(f"{option} is empty")
    return values


@dataclass(frozen=True)
class TuneOptions(Checked):
    """`pipeline tune-decoding`'s own options (its command line is generated from these fields; the decoding
    limits and the device are DecodingOptions' and LoadOptions')."""

    error = UserError

    src: Path = opt(help="Validation sources (never a test set).", path="any")
    ref: Path = opt(help="Validation references, line-aligned with --src.", path="any")
    beams: str = opt("1,4,6", "Beam widths to try, comma-separated.")
    alphas: str = opt("0.6,1.0", "Length penalties to try, comma-separated.")
    json_out: Path | None = opt(None, "Also write every trial as JSON to this file ('-': standard output, the table "
                                "then on standard error).", flag="--json")

    def beam_sizes(self) -> list[int]:
        """The beams, each once (`1,1` decoded every trial twice), in the order given."""
        return list(dict.fromkeys(parse_list(self.beams, int, self.flag("beams"))))

    def alpha_values(self) -> list[float]:
        return list(dict.fromkeys(parse_list(self.alphas, float, self.flag("alphas"))))

    def problems(self, name: Callable[[str], str] | None = None) -> list[str]:
        n = name or self.flag
        out = []
        for field_name, kind in (("beams", int), ("alphas", float)):
            try:
                parse_list(getattr(self, field_name), kind, n(field_name))
            except UserError as e:
                out.append(str(e))
        return out


def load_for_tuning(model: Path, device: str | None, threads: int | None = None
                    ) -> tuple[Backend, AnyTokenizer, dict[str, Any]]:
    """(backend, tokenizer, the model's own decoding defaults) of an exported model dir (its default
    backend) or of a checkpoint / training save dir (PyTorch; its averaged or latest checkpoint), on `threads`
    intra-op threads (None: the library's default)."""
    if (Path(model) / MANIFEST).is_file():
        loaded = load(model, LoadOptions(device=device, threads=threads).validate())
        return loaded.backend, loaded.tokenizer, loaded.model_dir.decoding_defaults
    from model.checkpoint import read_checkpoint, resolve_checkpoint  # without PyTorch: the CLI's one line
    from runtime.torch_backend import open_checkpoint

    backend, tokenizer = open_checkpoint(model, device=device, threads=threads)
    source = resolve_checkpoint(Path(model))
    if source != Path(model):  # a save dir: which of its checkpoints is tuned, as export says it
        log.info("%s: tuning %s", model, source.name)
    extra = read_checkpoint(source).get("extra") or {}
    return backend, tokenizer, extra.get("decoding") or {}


def tune_decoding(model: Path, src: Path, ref: Path, beams: list[int], alphas: list[float],
                  base: DecodingOptions, device: str | None = None, src_lang: str | None = None,
                  tgt_lang: str | None = None, threads: int | None = None) -> list[Trial]:
    """Every (beam, alpha) scored on src/ref, best BLEU first (ties: smaller beam, then alpha). A multilingual
    model translates src_lang -> tgt_lang (both needed, as serve-batch needs them; a one-pair model takes none)."""
    import sacrebleu

    if any(part in Path(src).name.lower() for part in ("test", "newstest")):
        log.warning("%s looks like a test set: choose decoding options on validation data, and keep "
                    "the test sets for the final score", src)
    sources, refs = read_lines(src), read_lines(ref)
    if len(sources) != len(refs):
        raise UserError(f"{src} has {len(sources)} lines but {ref} has {len(refs)}; they must be line-aligned")
    if not any(line.strip() for line in refs):
        raise UserError(f"{ref}: no reference line to score against (the file is empty or blank)")
    typed = {"beam_size": "--beams", "alpha": "--alphas"}  # problems named as typed
    early = {p for b in beams for a in alphas for p in base.replace(beam_size=b, alpha=a).problems(
        lambda k: typed.get(k, flag(k))) if p.startswith(tuple(typed.values()))}
    if early:  # a beam of 0 or a negative alpha, whatever the model: before it loads
        raise UserError("; ".join(sorted(early)))
    backend, tokenizer, defaults = load_for_tuning(model, device, threads)
    pair = ModelDir.open(model, verify=False).manifest.language_pair if (Path(model) / MANIFEST).is_file() else None
    way = direction(backend.cfg, src_lang, tgt_lang, pair=pair)  # none given, it decoded without language tokens
    if way.same:  # every surface copies such lines: a setting tuned on the model's en -> en output serves nothing
        raise UserError(f"--src-lang and --tgt-lang are both {way.source}: serve-batch writes every line as it came, "
                        "so there is no decoding to tune; choose two languages")
    base = base.for_model(defaults)  # an imported model tunes under its own search rules and limits
    grid = [base.replace(beam_size=beam, alpha=alpha) for beam in beams for alpha in alphas]
    # every trial checked before the first runs (a bad last one threw the finished ones away), named as typed
    problems = sorted({p for options in grid for p in options.problems(lambda k: typed.get(k, flag(k)))})
    problems += [f"--beams {beam}: this model's backend takes beams up to {backend.topk // 2} (it gives "
                 f"{backend.topk} candidates a step; beam search takes 2 x beam)" for beam in sorted(set(beams))
                 if 2 * beam > backend.topk]
    if problems:
        raise UserError("; ".join(problems))
    trials = []
    for options in grid:
        hyps = translate_lines(backend, tokenizer, sources, options, prefix=way.prefix, first=way.first)
        trial = Trial(options.beam_size, options.alpha, round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
                      round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2), options.max_len_a, options.max_len_b,
                      options.min_len, options.rules)
        log.info("beam %d alpha %.2f: BLEU %.2f chrF %.2f", trial.beam_size, trial.alpha, trial.bleu, trial.chrf)
        trials.append(trial)
    return sorted(trials, key=lambda t: (-t.bleu, t.beam_size, t.alpha))
