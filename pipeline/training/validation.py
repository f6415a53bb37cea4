"""Validation during training: teacher-forced loss and perplexity, and the BLEU of the
model's own translations (greedy by default; --valid-beam 4 is the paper's search)."""

from __future__ import annotations

import math
from typing import Any

import torch

from model.transformer import Transformer
from pipeline.corpus.data import PreparedData, iter_eval_batches
from pipeline.training.options import TrainOptions
from pipeline.training.step import batch_losses
from runtime.backend import DEFAULT_TOPK
from runtime.decoding import PAPER


@torch.no_grad()
def validate(model: Transformer, data: PreparedData, opts: TrainOptions, device: torch.device,
             precision: str) -> dict[str, Any]:
    """Validation loss (teacher forcing) and detokenized sacrebleu BLEU of greedy/beam output."""
    import sacrebleu

    from runtime.torch_backend import TorchBackend
    from runtime.translate import translate_lines

    assert data.valid is not None, "validate needs a validation set"
    model.eval()
    try:
        loss_sum = nll_sum = tokens = 0.0
        for batch in iter_eval_batches(data.valid, opts.batch_tokens):
            batch = batch.to(device)
            loss, nll = batch_losses(model, batch, opts.label_smoothing, precision, device)
            loss_sum, nll_sum, tokens = loss_sum + loss.item(), nll_sum + nll.item(), tokens + batch.n_tgt_tokens
        n = opts.valid_max_sentences or len(data.valid_src_lines)
        sources, refs = data.valid_src_lines[:n], data.valid_ref_lines[:n]
        # eager: the training model's shapes and weights change between validations (graphs: not yet measured there)
        # fuse=False: the optimizer holds these parameters, which fusing would replace
        # topk: the candidates a step of --valid-beam needs (a beam of 9 was refused at the first validation, after
        # the updates before it, and the run dropped as refused before its first checkpoint)
        backend = TorchBackend(model, device=device, max_src_len=opts.max_len, step_mode="eager", fuse=False,
                               topk=max(DEFAULT_TOPK, 2 * opts.valid_beam))
        # The paper's length penalty and length limit; only the beam width is ours (speed).
        decoding = PAPER.replace(beam_size=opts.valid_beam)
        hyps = translate_lines(backend, data.tokenizer, sources, decoding)
        bleu = sacrebleu.metrics.BLEU()
        score = bleu.corpus_score(hyps, [refs])
        return {"loss": loss_sum / tokens, "nll": nll_sum / tokens, "ppl": math.exp(min(nll_sum / tokens, 50)),
                "bleu": round(score.score, 2), "bleu_signature": str(bleu.get_signature()),
                "sentences": len(sources), "beam": opts.valid_beam}
    finally:
        model.train()
