"""The same weights in CTranslate2, for `pipeline bench --compare ctranslate2`.

Maps a model's weights to a CTranslate2 TransformerSpec (post-norm, shared embeddings,
our sinusoidal table), proves the mapping by token-identical greedy output against our
PyTorch model, and times CTranslate2's translate_batch on the same sources. CTranslate2
is the optional `bench` extra (`pip install -e .[bench]`), imported only here and lazily.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from model.errors import UserError
from runtime.search import greedy_search
from runtime.tokenizer import AnyTokenizer, Tokenizer
from runtime.translate import pad_batch

if TYPE_CHECKING:
    from runtime.shortlist import Shortlist

log = logging.getLogger(__name__)

# Our precision names -> CTranslate2 compute types (int8 GEMMs with per-row weight scales).
COMPUTE_TYPES = {"fp32": "float32", "int8": "int8"}


def import_ctranslate2() -> Any:
    try:
        import ctranslate2  # type: ignore[import-untyped]
    except ImportError:
        raise UserError("--compare ctranslate2 needs CTranslate2: `pip install -e .[bench]` "
                        "(or `pip install ctranslate2`)") from None
    return ctranslate2


def to_ct2_spec(model: Any, tokenizer: Tokenizer) -> Any:
    """A CTranslate2 TransformerSpec holding `model`'s fp32 weights."""
    from ctranslate2.specs import transformer_spec  # type: ignore[import-untyped]

    cfg = model.cfg
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.n_enc_layers, cfg.n_dec_layers), cfg.n_heads, pre_norm=False, no_final_norm=True)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    pe = model.pe.float().numpy()

    def linear(s: Any, name: str) -> None:
        s.weight, s.bias = sd[f"{name}.weight"], sd[f"{name}.bias"]

    def fused(s: Any, names: list[str]) -> None:
        s.weight = np.concatenate([sd[f"{n}.weight"] for n in names])
        s.bias = np.concatenate([sd[f"{n}.bias"] for n in names])

    def norm(s: Any, name: str) -> None:
        s.gamma, s.beta = sd[f"{name}.weight"], sd[f"{name}.bias"]

    def ffn(s: Any, name: str, ln: str) -> None:
        linear(s.linear_0, f"{name}.w1")
        linear(s.linear_1, f"{name}.w2")
        norm(s.layer_norm, ln)

    emb = sd["embed.weight"]
    spec.encoder.embeddings[0].weight = emb
    spec.encoder.position_encodings.encodings = pe
    for i, layer in enumerate(spec.encoder.layer):
        p = f"encoder.{i}"
        fused(layer.self_attention.linear[0], [f"{p}.self_attn.{x}_proj" for x in "qkv"])
        linear(layer.self_attention.linear[1], f"{p}.self_attn.out_proj")
        norm(layer.self_attention.layer_norm, f"{p}.res_attn.norm")
        ffn(layer.ffn, f"{p}.ffn", f"{p}.res_ffn.norm")
    spec.decoder.embeddings.weight = emb
    spec.decoder.position_encodings.encodings = pe
    spec.decoder.projection.weight = emb
    spec.decoder.projection.bias = np.zeros(emb.shape[0], dtype=np.float32)
    for i, layer in enumerate(spec.decoder.layer):
        p = f"decoder.{i}"
        fused(layer.self_attention.linear[0], [f"{p}.self_attn.{x}_proj" for x in "qkv"])
        linear(layer.self_attention.linear[1], f"{p}.self_attn.out_proj")
        norm(layer.self_attention.layer_norm, f"{p}.res_self.norm")
        linear(layer.attention.linear[0], f"{p}.cross_attn.q_proj")
        fused(layer.attention.linear[1], [f"{p}.cross_attn.{x}_proj" for x in "kv"])
        linear(layer.attention.linear[2], f"{p}.cross_attn.out_proj")
        norm(layer.attention.layer_norm, f"{p}.res_cross.norm")
        ffn(layer.ffn, f"{p}.ffn", f"{p}.res_ffn.norm")
    vocab = [tokenizer.sp.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(vocab)
    spec.config.bos_token = tokenizer.sp.id_to_piece(tokenizer.sp.bos_id())
    spec.config.eos_token = tokenizer.sp.id_to_piece(tokenizer.sp.eos_id())
    spec.config.unk_token = tokenizer.sp.id_to_piece(tokenizer.sp.unk_id())
    spec.config.decoder_start_token = spec.config.bos_token
    return spec


def convert(model: Any, tokenizer: Tokenizer, directory: Path) -> Path:
    """Write `model` as a CTranslate2 fp32 model dir (int8 is chosen at load: compute_type)."""
    import_ctranslate2()
    spec = to_ct2_spec(model, tokenizer)
    spec.validate()  # as ctranslate2's own converters do: check, then wrap the arrays
    spec.optimize(quantization=None)
    directory.mkdir(parents=True, exist_ok=True)
    spec.save(str(directory))
    return directory


def open_translator(directory: Path, threads: int, compute_type: str = "float32", inter_threads: int = 1) -> Any:
    """`threads` in all (0: CTranslate2's default), split over `inter_threads` batches translated at once."""
    ctranslate2 = import_ctranslate2()
    intra = threads // inter_threads if threads else 0
    return ctranslate2.Translator(str(directory), device="cpu", compute_type=compute_type,
                                  intra_threads=intra, inter_threads=inter_threads)


def ct2_translator(model: Any, tokenizer: Tokenizer, directory: Path, threads: int,
                   compute_type: str = "float32") -> Any:
    """Convert `model` into `directory` and open it with CTranslate2 on the CPU."""
    return open_translator(convert(model, tokenizer, directory), threads, compute_type)


class _ListedLanguageTokens:
    """An M2M100Tokenizer as CTranslate2's M2M-100 loader reads it: its language tokens (`__en__`...) listed in
    special_tokens_map["additional_special_tokens"], in id order. transformers 5 no longer lists them there
    (nor in get_vocab), so CTranslate2 4.x's loader would build a vocabulary without them and refuse the model
    ("Source vocabulary 0 has size N but the model expected ... N + languages"). Everything else is the
    tokenizer's own."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    @property
    def special_tokens_map(self) -> dict[str, Any]:
        listed = dict(self._tokenizer.special_tokens_map)
        if not listed.get("additional_special_tokens"):
            ordered = sorted(self._tokenizer.lang_token_to_id.items(), key=lambda item: item[1])
            listed["additional_special_tokens"] = [token for token, _ in ordered]
        return listed


def convert_transformers(hf_dir: Path, directory: Path) -> tuple[Path, str]:
    """An imported model's own directory converted by CTranslate2's TransformersConverter (its mapping,
    not ours), as a user of CTranslate2 would convert an OPUS-MT, M2M-100 or NLLB model; with how it was
    converted. An M2M100Tokenizer's language tokens are handed to the converter as it expects them
    (_ListedLanguageTokens), its weights, vocabulary and config are the converter's own."""
    ctranslate2 = import_ctranslate2()
    noted: list[str] = []

    class Converter(ctranslate2.converters.TransformersConverter):
        def load_tokenizer(self, tokenizer_class: Any, path: str, **kwargs: Any) -> Any:
            tokenizer = super().load_tokenizer(tokenizer_class, path, **kwargs)
            if hasattr(tokenizer, "lang_token_to_id") and \
                    not tokenizer.special_tokens_map.get("additional_special_tokens"):
                noted.append(" with M2M100Tokenizer's language tokens listed as additional_special_tokens "
                             "(transformers 5 no longer lists them; CTranslate2's loader needs them)")
                return _ListedLanguageTokens(tokenizer)
            return tokenizer

    Converter(str(hf_dir)).convert(str(directory), force=True)
    return directory, f"ctranslate2.converters.TransformersConverter({hf_dir})" + "".join(noted)


def vocabulary(directory: Path) -> list[str]:
    """A CTranslate2 model dir's tokens by id (shared_vocabulary.json, or .txt from older converters)."""
    import json

    if (directory / "shared_vocabulary.json").is_file():
        return list(json.loads((directory / "shared_vocabulary.json").read_text(encoding="utf-8")))
    return (directory / "shared_vocabulary.txt").read_text(encoding="utf-8").split("\n")[:-1]


def id_pieces(directory: Path, tokenizer: AnyTokenizer, by_id: bool = True) -> list[str]:
    """CTranslate2's token for each of our ids: its own vocabulary, by id, so that it is given exactly our source
    ids and its output maps back to ids whatever it names them (its M2M-100 loader names the padding ids
    `madeupwordN`, ours `madeupword000N`); a vocabulary of another size is not the same model. by_id False (a
    one-pair model, e.g. Marian's, whose converted vocabulary may leave out its unused <pad>): our own pieces,
    which CTranslate2 looks up by name, as before multilingual models."""
    if not by_id:
        return [tokenizer.piece(i) for i in range(tokenizer.vocab_size)]
    tokens = vocabulary(directory)
    if len(tokens) != tokenizer.vocab_size:
        raise UserError(f"{directory}: CTranslate2's vocabulary has {len(tokens)} tokens, the model "
                        f"{tokenizer.vocab_size}: not the same model")
    renamed = [i for i, t in enumerate(tokens) if t != tokenizer.piece(i)]
    if len(set(tokens)) != len(tokens):
        raise UserError(f"{directory}: CTranslate2's vocabulary repeats a token; ids cannot be given to it exactly")
    if renamed:
        log.info("CTranslate2 names %d of %d ids differently (first: %d %r, ours %r)", len(renamed), len(tokens),
                 renamed[0], tokens[renamed[0]], tokenizer.piece(renamed[0]))
    return tokens


def for_model_dir(model_dir: Path, directory: Path) -> tuple[Path, Any, AnyTokenizer, str]:
    """CTranslate2's copy of a model dir's model in `directory`, with (our fp32 model, its tokenizer, how it
    was converted): an imported model by CTranslate2's own TransformersConverter from the directory it came
    from, ours by to_ct2_spec from the fp32 checkpoint every export carries."""
    from model.checkpoint import load_model
    from model.manifest import CHECKPOINT_FILE
    from pipeline.evaluation.transformers_reference import imported_from
    from runtime.tokenizer import load_tokenizer

    model, tokenizer_bytes, payload = load_model(model_dir / CHECKPOINT_FILE)
    tokenizer = load_tokenizer(tokenizer_bytes)
    hf_dir = imported_from(model_dir / CHECKPOINT_FILE, payload)
    if hf_dir is not None:
        if model.cfg.encoder_heads != model.cfg.n_heads:
            raise UserError(f"{model_dir}: {model.cfg.encoder_heads} encoder heads and {model.cfg.n_heads} decoder "
                            "heads; CTranslate2's TransformersConverter gives both stacks the encoder's head count "
                            "(TransformerSpec.from_config takes one num_heads), so it cannot hold this model")
        converted, how = convert_transformers(hf_dir, directory)
        return converted, model, tokenizer, how
    if not isinstance(tokenizer, Tokenizer):
        raise UserError(f"{model_dir}: a Marian tokenizer without the directory it was imported from; "
                        "CTranslate2 cannot be given the same model")
    return convert(model, tokenizer, directory), model, tokenizer, "pipeline/evaluation/ctranslate2_compare.to_ct2_spec"


def greedy_agreement(model: Any, tokenizer: AnyTokenizer, translator: Any, sources: list[list[int]],
                     max_len: int = 20, first: int | None = None, pieces: list[str] | None = None) -> int:
    """Sentences whose greedy output is token-identical in CTranslate2 and our PyTorch model:
    proof that the benchmark compares the same model. `first`: the token forced first (a multilingual
    model's target language; CTranslate2's target_prefix); `pieces`: CTranslate2's token per id (id_pieces)."""
    from runtime.torch_backend import TorchBackend

    names = pieces or [tokenizer.piece(i) for i in range(tokenizer.vocab_size)]
    ids = {name: i for i, name in enumerate(names)}
    ours = greedy_search(TorchBackend(model), pad_batch(sources, model.cfg.pad_id), max_len_a=0.0,
                         max_len_b=max_len, first_tokens=None if first is None else [first] * len(sources))
    theirs = translator.translate_batch([[names[i] for i in s] for s in sources], beam_size=1,
                                        max_decoding_length=max_len, target_prefix=target_prefix(names, first,
                                                                                                  len(sources)))
    return sum(o[0].tokens == [ids.get(p, -1) for p in t.hypotheses[0]] for o, t in zip(ours, theirs))


def target_prefix(pieces: list[str], first: int | None, n: int) -> list[list[str]] | None:
    """CTranslate2's target_prefix for n sentences whose first token is forced (None: nothing forced)."""
    return None if first is None else [[pieces[first]] for _ in range(n)]


def write_vmap(table: Shortlist, ct2_dir: Path, tokenizer: AnyTokenizer) -> Path:
    """CTranslate2's vocabulary map (vmap.txt: `source piece<TAB>target pieces`, the line with an empty
    source holding the pieces that are always candidates) from a model dir's shortlist table (ModelDir.shortlist),
    so that CTranslate2 + vmap decodes over the same candidates as our --shortlist."""
    lines = ["\t" + " ".join(tokenizer.piece(int(i)) for i in table.frequent)]
    for source in np.flatnonzero(np.diff(table.offsets)):
        targets = table.targets[table.offsets[source]:table.offsets[source + 1]]
        lines.append(tokenizer.piece(int(source)) + "\t" + " ".join(tokenizer.piece(int(i)) for i in targets))
    path = ct2_dir / "vmap.txt"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def bench_translator(translator: Any, src_tokens: list[list[str]], batch_size: int, beam_size: int,
                     fixed_length: int | None, length_penalty: float = 0.6, use_vmap: bool = False,
                     prefix: list[list[str]] | None = None, parallel_batches: int = 1) -> dict[str, Any]:
    """Time translate_batch as bench_backend times our search: one warm-up batch, then all (use_vmap:
    over the model's vocabulary map, write_vmap; prefix: each sentence's target_prefix). With
    `parallel_batches` (the translator's inter_threads), all batches are given in one call, which CTranslate2
    cuts into batch_size batches and translates that many at once; a batch's latency is then estimated as
    the call's time per batch times the batches at once."""
    opts: dict[str, Any] = dict(beam_size=beam_size, max_batch_size=batch_size, length_penalty=length_penalty,
                                use_vmap=use_vmap)
    if fixed_length:
        opts.update(max_decoding_length=fixed_length, min_decoding_length=fixed_length)
    def part(i: int, n: int = batch_size) -> dict[str, Any]:
        return {} if prefix is None else {"target_prefix": prefix[i: i + n]}

    translator.translate_batch(src_tokens[:batch_size], **opts, **part(0))
    latencies, tokens = [], 0
    t0 = time.perf_counter()
    if parallel_batches > 1:
        out = translator.translate_batch(src_tokens, **opts, **part(0, len(src_tokens)))
        tokens = sum(len(r.hypotheses[0]) for r in out)
        n_batches = -(-len(src_tokens) // batch_size)
        latencies.append((time.perf_counter() - t0) * 1000 * min(parallel_batches, n_batches) / n_batches)
    else:
        for i in range(0, len(src_tokens), batch_size):
            t = time.perf_counter()
            out = translator.translate_batch(src_tokens[i: i + batch_size], **opts, **part(i))
            latencies.append((time.perf_counter() - t) * 1000)
            tokens += sum(len(r.hypotheses[0]) for r in out)
    seconds = time.perf_counter() - t0
    return {"target_tokens": tokens, "seconds": round(seconds, 3),
            "target_tokens_per_s": round(tokens / seconds, 1),
            "sentences_per_s": round(len(src_tokens) / seconds, 2),
            "latency_ms_mean": round(statistics.fmean(latencies), 2),
            "latency_ms_per_sentence": round(seconds * 1000 / len(src_tokens), 2)}
