"""What a checkpoint's payload decides of a model dir: its decoding defaults under export's options (checked
against the dir's limits) and the training steps its weights come from."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from export.errors import ExportError
from model.manifest import Limits
from runtime.decoding import PAPER

log = logging.getLogger(__name__)


def decoding_defaults(payload: dict[str, Any], given: dict[str, Any] | None = None,
                      limits: Limits | None = None) -> dict[str, Any]:
    """The model dir's decoding defaults: the checkpoint's own (an imported model's generation config) under
    those `given` to export (--beam-size, --alpha, ...), checked; a given beam must fit the model dir (at most
    --max-beam, whose 2 x beam candidates check_options fits in --topk), and a default one is cut to fit (a dir
    of --max-beam 1 could not translate with the paper's beam 4)."""
    defaults = dict((payload.get("extra") or {}).get("decoding") or {})
    PAPER.for_model(defaults, "the checkpoint")  # unknown or impossible values: one line now
    beam = (given or {}).get("beam_size")
    if beam is not None and limits is not None and beam > limits.max_beam:
        raise ExportError(f"--beam-size {beam} is above --max-beam {limits.max_beam}, the largest beam the model "
                          "dir serves: raise --max-beam or choose a smaller beam")
    if limits is not None and beam is None and defaults.get("beam_size", PAPER.beam_size) > limits.max_beam:
        log.info("the model dir's default beam is --max-beam %d (the checkpoint's or the paper's is larger)",
                 limits.max_beam)
        defaults["beam_size"] = limits.max_beam
        if "nbest" in defaults:
            defaults["nbest"] = min(defaults["nbest"], limits.max_beam)
    if not given:
        return defaults
    merged = {**defaults, **given}
    PAPER.for_model(merged, "the options given over the checkpoint's own")  # min-len past the checkpoint's max
    min_len = given.get("min_len")
    if min_len is not None and limits is not None and min_len > limits.max_tgt_len - 1:
        raise ExportError(f"--min-len {min_len} is above the longest output the model dir allows, "
                          f"{limits.max_tgt_len - 1} tokens (--max-tgt-len {limits.max_tgt_len}): no translation "
                          "could meet it")
    return merged


def checkpoint_steps(payload: dict[str, Any]) -> list[int]:
    """The training steps a checkpoint's weights come from: an averaged checkpoint's
    `extra["steps"]` (or, as older ones record, its `extra["averaged"]` file names
    checkpoint_<step>.pt); a step checkpoint's train_state step; checkpoint_best.pt's `extra["step"]` (the step
    validated best; it keeps no training state); else none known."""
    extra = payload.get("extra") or {}
    if isinstance(extra.get("steps"), list):
        return [int(s) for s in extra["steps"]]
    if isinstance(extra.get("averaged"), list):
        names = [re.fullmatch(r"checkpoint_(\d+)\.pt", Path(str(n)).name) for n in extra["averaged"]]
        return sorted(int(m.group(1)) for m in names if m)
    state = payload.get("train_state")
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, int):
        step = extra.get("step")
    return [int(step)] if isinstance(step, int) and not isinstance(step, bool) else []
