"""One beam search step on the device, in place on a search's state tensors: runtime/device_search.py's body
(its docstring says what each part does and why the result is runtime/search.py's)."""

from __future__ import annotations

from typing import Any

import torch

from model.config import MASK_VALUE
from model.transformer import Transformer
from runtime.static_step import raise_recompile_limits

NEG_INF = float("-inf")


def one_step(model: Transformer, st: dict[str, Any], beam: int, eos: int) -> None:
    """One decoder step and one beam search step, in place on the state tensors `st` (see _Store)."""
    cfg = model.cfg
    t, pos, scores = st["t"], st["pos"], st["scores"]
    n_sent, n_cand = scores.shape[0], 2 * beam
    n, cap = pos.shape
    index = st["head_start"] + pos.clamp(min=0)[:, None, :]
    bias = (pos < 0).float() * MASK_VALUE
    log_probs, step_k, step_v = model.decode_step(st["tokens"], t.clamp(max=cfg.max_positions - 1), index, bias,
                                                  st["k"], st["v"], st["cross_k"], st["cross_v"], st["src_bias"])
    write_pos = t * beam + st["row_in_sentence"]
    for buf, new in zip(st["k"] + st["v"], step_k + step_v):
        buf.index_copy_(2, write_pos, new.view(n_sent, beam, cfg.n_heads, cfg.d_head).transpose(1, 2))

    # the rows' candidates (search's _step_candidates)
    lp = log_probs.float()
    top_lp, top_ids = lp.topk(n_cand, dim=-1)
    top_lp = torch.where((top_ids == eos) & (t < st["min_len"]), NEG_INF, top_lp)
    at_limit = (st["row_max"] <= t)[:, None]
    forced = torch.where(st["cand"] == 0, lp[:, eos:eos + 1], NEG_INF)
    top_lp = torch.where(at_limit, forced, top_lp)
    top_ids = torch.where(at_limit, eos, top_ids)
    # each sentence's best 2 x beam (search: cum, _best)
    cum = (scores.view(-1, 1) + top_lp).view(n_sent, beam * n_cand)
    ranked, order = cum.sort(dim=1, descending=True, stable=True)
    top_idx, top_scores = order[:, :n_cand], ranked[:, :n_cand]
    top_tok = top_ids.view(n_sent, -1).gather(1, top_idx)
    top_step_lp = top_lp.view(n_sent, -1).gather(1, top_idx)
    top_beam = top_idx // n_cand
    eos_cand = top_tok == eos
    cand_pos = st["cand"]

    # finalise EOS among the first `beam` into the sentence's next free slots (slot `beam`: discarded)
    final = eos_cand & torch.isfinite(top_scores) & (cand_pos < beam) & ~st["done"][:, None]
    slot = st["count"][:, None] + final.long().cumsum(1) - 1
    accept = final & (slot < beam)
    target = (st["sentence"][:, None] * (beam + 1) + torch.where(accept, slot, beam)).view(-1)
    parent = (st["sentence"][:, None] * beam + top_beam).view(-1)
    st["fin_tok"].view(-1, cap).index_copy_(0, target, st["hist"].view(n, cap).index_select(0, parent))
    step_lps = st["hist_lp"].view(n, cap).index_select(0, parent)
    step_lps.scatter_(1, t.expand(parent.shape[0], 1), top_step_lp.reshape(-1, 1))
    st["fin_lp"].view(-1, cap).index_copy_(0, target, step_lps)
    penalty = st["penalty"].index_select(0, t.clamp(max=st["penalty"].shape[0] - 1))
    st["fin_score"].view(-1).index_copy_(0, target, (top_scores / penalty).view(-1))
    st["fin_logp"].view(-1).index_copy_(0, target, top_scores.reshape(-1))
    st["fin_len"].view(-1).index_copy_(0, target, (t + 1).expand(target.shape[0]))
    count = st["count"] + accept.long().sum(1)
    st["count"].copy_(count)
    st["done"].copy_(st["done"] | (count >= beam) | (st["max_len"] <= t))

    # continue with the best `beam` non-EOS candidates, in their order
    keep = (eos_cand.long() * n_cand + cand_pos).argsort(dim=1)[:, :beam].sort(dim=1).values
    next_beam, next_tok = top_beam.gather(1, keep), top_tok.gather(1, keep)
    rows = (st["sentence"][:, None] * beam + next_beam).view(-1)
    at_t = t.expand(n, 1)
    hist = st["hist"].view(n, cap).index_select(0, rows)
    hist.scatter_(1, at_t, next_tok.view(n, 1))
    st["hist"].view(n, cap).copy_(hist)
    hist_lp = st["hist_lp"].view(n, cap).index_select(0, rows)
    hist_lp.scatter_(1, at_t, top_step_lp.gather(1, keep).view(n, 1))
    st["hist_lp"].view(n, cap).copy_(hist_lp)
    new_pos = pos.index_select(0, rows)
    new_pos.scatter_(1, at_t, t * beam + next_beam.view(n, 1))
    pos.copy_(new_pos)
    scores.copy_(top_scores.gather(1, keep))
    st["tokens"].copy_(next_tok.view(-1))
    t.add_(1)


def compile_step() -> Any:
    """one_step through torch.compile: fixed shapes but the cache capacity, the whole step one graph. One
    compiled step serves every steps-per-replay: a replay calls it K times, and the capture records them all."""
    raise_recompile_limits()
    return torch.compile(one_step, dynamic=False, fullgraph=True)
