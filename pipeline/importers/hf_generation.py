"""transformers' generation_config.json (else config.json) as our decoding defaults, for every importer:
checked here, naming its fields, rather than blamed on a command-line option later."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from model.config import ModelConfig
from pipeline.importers.hf_files import HFFiles, ImportRefused, number, optional_integer, show
from runtime.decoding import DecodingOptions

log = logging.getLogger(__name__)

GENERATION = "generation_config.json"
GENERATION_NAMES = {"beam_size": "num_beams", "alpha": "length_penalty", "max_len_b": "max_length",
                    "min_len": "min_length"}  # our DecodingOptions fields as generation_config.json names them


# generate's settings that change its output, with transformers' defaults (GenerationConfig): none is imported,
# so a value other than the default is named in a warning (sampling's own, top_k and the like, act only with
# do_sample, named itself)
CHANGES_OUTPUT: tuple[tuple[str, Any], ...] = (
    ("no_repeat_ngram_size", 0), ("encoder_no_repeat_ngram_size", 0), ("repetition_penalty", 1.0),
    ("encoder_repetition_penalty", 1.0), ("do_sample", False), ("suppress_tokens", []), ("begin_suppress_tokens", []),
    ("max_new_tokens", None), ("min_new_tokens", None), ("forced_bos_token_id", None), ("forced_decoder_ids", None),
    ("renormalize_logits", False), ("num_beam_groups", 1), ("diversity_penalty", 0.0),
    ("exponential_decay_length_penalty", None), ("force_words_ids", None), ("sequence_bias", None),
    ("penalty_alpha", None), ("guidance_scale", None), ("max_time", None), ("stop_strings", None),
    ("constraints", None))


def _suppressed(gen: dict[str, Any], where: Path, cfg: ModelConfig) -> tuple[int, ...]:
    """The ids of bad_words_ids: single-token entries only, never the eos id."""
    entries = gen.get("bad_words_ids") or []
    if not isinstance(entries, list):
        raise ImportRefused(f"{where}: bad_words_ids is {show(entries)}; expected a list of [id] lists")
    suppress = []
    for words in entries:
        if not isinstance(words, list) or len(words) != 1 or isinstance(words[0], bool) \
                or not isinstance(words[0], int):
            raise ImportRefused(f"{where}: bad_words_ids entry {show(words)}: only single-token entries "
                                    "(the padding id, as OPUS-MT ships) can be imported")
        if not 0 <= words[0] < cfg.vocab_size or words[0] == cfg.eos_id:
            raise ImportRefused(f"{where}: bad_words_ids entry {words}: not an id of the vocabulary other than "
                                    f"the eos id {cfg.eos_id} (0..{cfg.vocab_size - 1})")
        suppress.append(words[0])
    return tuple(sorted(set(suppress)))


def generation(files: HFFiles, config: dict[str, Any], cfg: ModelConfig) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(our decoding defaults, ids never generated) from generation_config.json (else config.json),
    checked here, naming its fields, rather than blamed on a command-line option later."""
    present = files.has(GENERATION)
    gen = files.json(GENERATION) if present else config
    where = files.path(GENERATION) if present else files.dir / "config.json"
    suppress = _suppressed(gen, where, cfg)
    forced = gen.get("forced_eos_token_id", cfg.eos_id)
    if isinstance(forced, list) and len(forced) == 1:
        forced = forced[0]
    if forced is not None and (isinstance(forced, bool) or forced != cfg.eos_id):
        raise ImportRefused(f"{where}: forced_eos_token_id {show(forced)} is not the eos id {cfg.eos_id}")
    early = gen.get("early_stopping")
    if early not in (None, False, True):
        raise ImportRefused(f"{where}: early_stopping {show(early)}: only true and false (transformers' "
                            "default) are implemented (runtime/search.py)")
    ignored = {k: gen[k] for k, default in CHANGES_OUTPUT if gen.get(k) not in (None, default)}
    if present:  # generate takes these from generation_config.json; the import took config.json's
        ignored.update({k: gen[k] for k in ("decoder_start_token_id", "eos_token_id", "pad_token_id")
                        if gen.get(k) is not None and config.get(k) is not None
                        and gen[k] not in (config[k], [config[k]])})
    if ignored:
        log.warning("%s: %s not imported: the model dir decodes without them", where,
                    ", ".join(f"{k}={v!r}" for k, v in ignored.items()))
    max_length = optional_integer(gen, "max_length", where, 512, minimum=3,
                                   why=" (it counts the decoder start and the EOS: 3 leaves room for one token)")
    min_length = optional_integer(gen, "min_length", where, 0, minimum=0)
    if min_length > max_length - 1:
        raise ImportRefused(f"{where}: min_length {min_length} is above {max_length - 1}, the most that max_length "
                            f"{max_length} leaves (both count the decoder start token)")
    alpha = number(gen, "length_penalty", where, 1.0)
    if alpha < 0:
        raise ImportRefused(f"{where}: length_penalty {alpha} is negative; our search takes 0 or more")
    defaults: dict[str, Any] = {
        "rules": "transformers-early" if early is True else "transformers",
        "beam_size": optional_integer(gen, "num_beams", where, 1, minimum=1),
        "alpha": alpha,
        # transformers' max_length counts the decoder start token and the EOS
        "max_len_a": 0.0, "max_len_b": max_length - 2,
        "min_len": max(0, min_length - 1),
    }
    # what a model dir's defaults must pass (runtime.decoding), named as generation_config.json names them
    problems = DecodingOptions(**defaults).problems(name=lambda field: GENERATION_NAMES.get(field, field))
    if problems:
        raise ImportRefused(f"{where}: impossible decoding defaults ({'; '.join(problems)})")
    return defaults, suppress
