"""`pipeline parity --reference transformers`: an imported model's source directory translated by
transformers itself (`MarianTokenizer` + `MarianMTModel.generate`, or `M2M100Tokenizer` +
`M2M100ForConditionalGeneration.generate` with the source language set and the target's token forced
first), the independent implementation an import is checked against.

The lines are read as serve-batch reads them (blank lines stay blank and are not translated); the
tokenizer, the model and the search are transformers' own, with the generation config the directory
ships and our decoding options in its place where they correspond: beam size (num_beams), alpha
(length_penalty) and the length limit (max_length = max_len_b + 2: transformers counts the decoder
start token and the EOS; capped where our search caps it, at the decoder's positions), the least length
(min_length = min_len + 1, counted alike), early_stopping (rules transformers-early). Only transformers' search
rules compare token for token, so other rules are refused.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from model.errors import UserError
from runtime.decoding import DecodingOptions
from runtime.errors import first_line

log = logging.getLogger(__name__)

BATCH = 16  # sentences per generate call
# the files transformers reads of a directory (configs, weights and their index, tokenizers), by their endings
READ_BY_TRANSFORMERS = (".json", ".safetensors", ".bin", ".spm", ".model")


def source_dir(checkpoint: Path, given: Path | None) -> Path | None:
    """The Hugging Face directory to compare with: `given` (--hf-dir: a directory, a cache's models--ORG--NAME
    or a hub id found in the cache, as `pipeline import` takes them), else the one the checkpoint records (None
    for our own checkpoints), once its files are those the import read: each one there that the import hashed
    (extra.imported.files) and transformers reads is hashed again, and one that differs is a UserError naming
    it (parity failed as if our backends were wrong), as is one that transformers may read and was not there
    at the import (a model.safetensors added beside the .bin imported); a missing one is warned of (a copy in
    another format deleted changes nothing). A directory that is not there is one line."""
    from model.checkpoint import read_checkpoint
    from pipeline.importers.hf_files import ImportRefused, digest
    from pipeline.importers.hub_cache import resolve_model_dir

    imported = (read_checkpoint(checkpoint).get("extra") or {}).get("imported") or {}
    if not imported:  # trained here: any --hf-dir is another model (0% identical against an unrelated Marian)
        if given is not None:
            raise UserError(f"--hf-dir {given}: this model was not imported (trained here), so no Hugging Face model "
                            "is its reference; compare it with --reference torch")
        return None
    if given is not None:
        try:
            hf_dir = resolve_model_dir(given)
        except ImportRefused as e:
            raise UserError(f"--hf-dir {e}") from None
        if not hf_dir.is_dir():
            raise UserError(f"--hf-dir {given}: no such directory")
    elif imported.get("directory"):
        hf_dir = Path(imported["directory"])
        if not hf_dir.is_dir():
            raise UserError(f"{hf_dir}: the directory this model was imported from is not here; pass --hf-dir")
    else:
        return None
    files = imported.get("files") or {}
    missing = []
    for name, recorded in sorted(files.items()):
        if not name.endswith(READ_BY_TRANSFORMERS):  # a model card or .gitattributes edited changes no translation
            continue
        path = hf_dir / name
        try:
            now = digest(path)
        except FileNotFoundError:  # a copy of one format deleted changes nothing; a tokenizer file fails the load
            missing.append(name)
            continue
        except OSError as e:
            raise UserError(f"{path}: unreadable ({e.strerror or e}), though the import read it") from None
        if now != recorded:
            raise UserError(f"{path}: not the file this model was imported from (sha256 {now[:12]}..., imported "
                            f"{recorded[:12]}...); give the directory it was imported from (--hf-dir), or import this "
                            "one")
    if missing:  # (transformers' own error then, "expected str, ... not NoneType", said nothing of it)
        log.warning("%s: %s missing since the import read the directory; transformers may not load it, or translate "
                    "otherwise", hf_dir, ", ".join(missing))
    known = {*files, *(imported.get("unhashed") or {}), *(imported.get("skipped") or ())}
    added = sorted(p.name for p in hf_dir.iterdir() if files and p.name not in known
                   and p.name.endswith(READ_BY_TRANSFORMERS) and p.is_file())
    if added:  # a model.safetensors beside the .bin imported: transformers reads it first (16.7% identical)
        raise UserError(f"{hf_dir / added[0]}: not there when this model was imported, and transformers may read it"
                        f"{f' (and {len(added) - 1} more)' if len(added) > 1 else ''}; give the directory it was "
                        "imported from (--hf-dir), or import this one")
    return hf_dir


def imported_from(checkpoint: Path, payload: dict[str, Any] | None = None) -> Path | None:
    """The directory an imported checkpoint was made from (None for our own checkpoints); `payload`:
    the checkpoint already read."""
    from model.checkpoint import read_checkpoint

    payload = read_checkpoint(checkpoint) if payload is None else payload
    directory = ((payload.get("extra") or {}).get("imported") or {}).get("directory")
    return Path(directory) if directory else None


def generation_settings(hf_dir: Path, decoding: DecodingOptions, max_tgt_len: int | None = None) -> Any:
    """The directory's GenerationConfig with our decoding options where they correspond; the length limit capped
    as our search caps it, to what the decoder's positions hold (`max_tgt_len` - 1 tokens and the EOS: past them
    transformers' position embedding raised an IndexError, where --max-len-b or the model dir's limit was larger)."""
    from transformers import GenerationConfig

    if not decoding.rules.startswith("transformers"):
        raise UserError(f"--reference transformers compares token for token only under transformers' search "
                        f"rules; this run decodes with --rules {decoding.rules}")
    if decoding.max_len_a != 0:
        raise UserError("--reference transformers takes a fixed length limit (--max-len-a 0), as transformers' "
                        "max_length is")
    try:
        gen = GenerationConfig.from_pretrained(str(hf_dir), local_files_only=True)
    except OSError:
        gen = GenerationConfig()
    gen.num_beams = decoding.beam_size
    gen.length_penalty = decoding.alpha
    most = decoding.max_len_b if max_tgt_len is None else min(decoding.max_len_b, max_tgt_len - 1)
    gen.max_length = most + 2
    gen.max_new_tokens = None
    gen.min_length = decoding.min_len + 1 if decoding.min_len else 0  # it counts the decoder start token too
    gen.min_new_tokens = None
    gen.early_stopping = decoding.rules == "transformers-early"
    gen.do_sample = False
    gen.num_return_sequences = 1
    return gen


def _load(hf_dir: Path, src_lang: str | None, tgt_lang: str | None, multilingual: bool
          ) -> tuple[Any, Any, dict[str, Any]]:
    """(tokenizer, model, extra generate arguments) of the directory's family, as its config.json names it;
    refused when it is not the kind of model compared with (`multilingual`: the model dir lists languages)."""
    import json

    from transformers import (
        M2M100ForConditionalGeneration,
        M2M100Tokenizer,
        MarianMTModel,
        MarianTokenizer,
        NllbTokenizer,
    )

    from pipeline.importers.m2m100 import is_nllb

    model_type = json.loads((Path(hf_dir) / "config.json").read_text(encoding="utf-8")).get("model_type")
    if (model_type == "m2m_100") != multilingual:
        kind = "multilingual" if multilingual else "one-pair"
        raise UserError(f"--hf-dir {hf_dir}: holds a {model_type} model, not the {kind} model of this model dir; "
                        "give the directory it was imported from")
    if model_type == "m2m_100":
        if not src_lang or not tgt_lang:
            raise UserError("--reference transformers on a multilingual model needs --src-lang and --tgt-lang")
        nllb = is_nllb(Path(hf_dir))
        tokenizer = (NllbTokenizer if nllb else M2M100Tokenizer).from_pretrained(str(hf_dir), local_files_only=True)
        tokenizer.src_lang = src_lang
        model = M2M100ForConditionalGeneration.from_pretrained(str(hf_dir), local_files_only=True,
                                                               attn_implementation="eager")
        forced = tokenizer.convert_tokens_to_ids(tgt_lang if nllb else tokenizer.get_lang_token(tgt_lang))
        return tokenizer, model.eval(), {"forced_bos_token_id": forced}
    tokenizer = MarianTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    model = MarianMTModel.from_pretrained(str(hf_dir), local_files_only=True, attn_implementation="eager")
    return tokenizer, model.eval(), {}


def translate(hf_dir: Path, lines: list[str], decoding: DecodingOptions, src_lang: str | None = None,
              tgt_lang: str | None = None, max_src_len: int | None = None,
              languages: frozenset[int] = frozenset(), max_tgt_len: int | None = None
              ) -> tuple[list[str], list[list[int]], float]:
    """(output lines, token ids without start and EOS, seconds) of transformers on `lines`; a multilingual
    model's ids start with the forced target-language token, its text holds no language token (`languages`, the
    model dir's: our tokenizer writes none, transformers' kept one generated later). A source over `max_src_len`
    tokens (its language token and EOS counted) is cut to it as serve-batch cuts it: the first pieces, then
    the EOS (past the model's positions it was an IndexError from the embedding)."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        raise UserError("--reference transformers needs Hugging Face transformers: pip install -e \".[import]\"") \
            from None
    if not Path(hf_dir).is_dir():
        raise UserError(f"{hf_dir}: the directory this model was imported from is not here; pass --hf-dir")
    try:
        gen = generation_settings(hf_dir, decoding, max_tgt_len)
        tokenizer, model, forced = _load(hf_dir, src_lang, tgt_lang, bool(languages))
    except UserError:
        raise
    except (OSError, ValueError, TypeError, KeyError) as e:  # a directory changed since its import (or never
        # checked: a checkpoint that records no digests): transformers' own error, as one line
        raise UserError(f"--hf-dir {hf_dir}: transformers cannot load it ({first_line(e)}); give the directory "
                        "this model was imported from") from None
    eos = model.config.eos_token_id
    live = [i for i, line in enumerate(lines) if line.strip()]
    texts, tokens = [""] * len(lines), [[] for _ in lines]
    started = time.perf_counter()
    for start in range(0, len(live), BATCH):
        chunk = live[start: start + BATCH]
        batch = tokenizer([lines[i] for i in chunk], return_tensors="pt", padding=True,
                          truncation=max_src_len is not None, max_length=max_src_len)
        with torch.inference_mode():
            out = model.generate(**batch, generation_config=gen, **forced)
        for i, row in zip(chunk, out.tolist()):
            ids = []
            for token in row[1:]:  # after the decoder start token, up to the first EOS
                if token == eos:
                    break
                ids.append(token)
            tokens[i] = ids
            text_ids = [token for token in ids if token not in languages]
            texts[i] = tokenizer.decode(text_ids, skip_special_tokens=True)
    return texts, tokens, time.perf_counter() - started
