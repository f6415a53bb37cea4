"""Parallel text -> SentencePiece ids -> token-budget batches, one shard per rank.

Reading is strict (invalid UTF-8 names file and line; mismatched line counts name both
files and both counts). The joint SentencePiece model and the encoded corpus are cached
in the save dir under a key made of the input files' paths, sizes and SHA-256s
(file_fingerprint, also what a resumed run checks its corpus against) and the options
that change them, so a second run neither retrains nor re-encodes.

Batching follows the paper: sentences of similar length are packed together up to a
token budget (`batch_tokens` counts the padded size of the larger side, max(S, T) *
rows). Batches are made per epoch from (seed, epoch) only, identically on every rank;
one optimizer update consumes a *group* of world_size * update_freq consecutive batches
and rank r takes group[r::world_size]. An epoch's last incomplete group is dropped (its
sentences come back, reshuffled, in the next epoch), so every rank sees the same number
of batches and the global batch never depends on the number of processes.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from model.checkpoint import CheckpointError, atomic_torch_save, torch_load_verified
from model.config import BOS_ID, EOS_ID, PAD_ID
from model.errors import UserError
from model.manifest import SPM_FILE
from pipeline.corpus.spm import train_sentencepiece
from pipeline.textio import CORPUS_LINE_BYTES, atomic_output, read_lines
from runtime.tokenizer import Tokenizer, TokenizerError

log = logging.getLogger(__name__)

CACHE_DIR = "cache"
CACHE_VERSION = 3  # 2: files keyed by content, caches carry a checksum; 3: `rows` (line of each kept pair)
# real text has 3 to 6 characters a token: a side over --max-len x this many is over --max-len whatever it holds, and
# is dropped before it is tokenized (a 20 MB line took 1.3 GB; 200,000 of one unseen character trained as "▁<unk>")
CHARS_PER_TOKEN = 64


# -- reading ---------------------------------------------------------------------------

def read_parallel(src_path: Path, tgt_path: Path) -> tuple[list[str], list[str]]:
    """Both sides of a parallel corpus, checked: present, non-empty, UTF-8, aligned."""
    # lines end at \n only: CR-only ends (one pair) are refused by read_lines; a line longer than any --max-len
    # is dropped and counted after reading (CHARS_PER_TOKEN), up to CORPUS_LINE_BYTES, where /dev/zero stops
    src, tgt = (read_lines(path, max_line_bytes=CORPUS_LINE_BYTES) for path in (src_path, tgt_path))
    for path, lines in ((src_path, src), (tgt_path, tgt)):
        if not any(line.strip() for line in lines):
            raise UserError(f"{path}: file is empty (no non-empty lines); give a corpus with text in it")
    if len(src) != len(tgt):
        raise UserError(f"line counts differ: {src_path} has {len(src)} lines but {tgt_path} has "
                        f"{len(tgt)}; the two files of a parallel corpus must be line-aligned")
    return src, tgt


# (path, size, mtime, inode, device) -> SHA-256: the cache key and the resume check both
# fingerprint the same files; hash each once per process while it stays the same file.
_DIGESTS: dict[tuple[str, int, int, int, int], str] = {}


def file_fingerprint(paths: list[Path]) -> list[dict[str, Any]]:
    """What identifies an input file: absolute path, size and SHA-256 of its bytes
    (streamed in 4 MiB blocks, so a corpus of any size costs one sequential read)."""
    out = []
    for p in paths:
        path = Path(p).resolve()
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
        if key not in _DIGESTS:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
            _DIGESTS[key] = h.hexdigest()
        out.append({"path": str(path), "size": st.st_size, "sha256": _DIGESTS[key]})
    return out


def cache_key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


# -- encoded corpora -------------------------------------------------------------------

@dataclass
class EncodedCorpus:
    """Token ids of both sides, flat with offsets (compact to cache and to slice).

    Stored without specials: sources get EOS appended, targets BOS/EOS, at collate time.
    """

    src_ids: np.ndarray  # int32, all source sentences concatenated
    src_offsets: np.ndarray  # int64, len n + 1
    tgt_ids: np.ndarray
    tgt_offsets: np.ndarray
    rows: np.ndarray | None = None  # int64: the input line of each kept pair (subword sampling reads it)

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    @property
    def src_lens(self) -> np.ndarray:
        return np.diff(self.src_offsets)

    @property
    def tgt_lens(self) -> np.ndarray:
        return np.diff(self.tgt_offsets)

    def src(self, i: int) -> np.ndarray:
        return self.src_ids[self.src_offsets[i]:self.src_offsets[i + 1]]

    def tgt(self, i: int) -> np.ndarray:
        return self.tgt_ids[self.tgt_offsets[i]:self.tgt_offsets[i + 1]]

    def to_dict(self) -> dict[str, np.ndarray]:
        return {"src_ids": self.src_ids, "src_offsets": self.src_offsets,
                "tgt_ids": self.tgt_ids, "tgt_offsets": self.tgt_offsets, "rows": self.rows}


def _flatten(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in seqs])
    flat = np.fromiter((t for s in seqs for t in s), dtype=np.int32, count=int(offsets[-1]))
    return flat, offsets


def encode_and_filter(tokenizer: Tokenizer, src: list[str], tgt: list[str], max_len: int,
                      name: str, files: str = "") -> EncodedCorpus:
    """Encode both sides; drop pairs with an empty side or longer than max_len tokens
    (specials included; a side of more than max_len x CHARS_PER_TOKEN characters is not tokenized), and log how
    many of each."""
    huge = {row for row, (s_text, t_text) in enumerate(zip(src, tgt))
            if max(len(s_text), len(t_text)) > max_len * CHARS_PER_TOKEN}
    if huge:
        src, tgt = ([text if row not in huge else "" for row, text in enumerate(side)] for side in (src, tgt))
    src_enc, tgt_enc = tokenizer.encode(src), tokenizer.encode(tgt)
    keep_src, keep_tgt, rows = [], [], []
    n_empty = n_long = 0
    for row, (s_text, t_text, s, t) in enumerate(zip(src, tgt, src_enc, tgt_enc)):
        if row in huge:
            n_long += 1
        elif not s_text.strip() or not t_text.strip() or not s or not t:
            n_empty += 1
        elif len(s) + 1 > max_len or len(t) + 1 > max_len:
            n_long += 1
        else:
            keep_src.append(s)
            keep_tgt.append(t)
            rows.append(row)
    log.info("%s: %d pairs read, %d with an empty side dropped, %d longer than --max-len %d "
             "tokens dropped, %d kept", name, len(src), n_empty, n_long, max_len, len(keep_src))
    if not keep_src:
        why = "" if name == "train" else " (the validation loss needs one; BLEU translates every line)"
        where = f"{name} ({files})" if files else name
        raise UserError(f"{where}: no sentence pair left after filtering ({n_empty} empty, {n_long} longer than "
                        f"--max-len {max_len}){why}; raise --max-len or check the files")
    s_flat, s_off = _flatten(keep_src)
    t_flat, t_off = _flatten(keep_tgt)
    return EncodedCorpus(s_flat, s_off, t_flat, t_off, np.asarray(rows, dtype=np.int64))


@dataclass
class PreparedData:
    """What training needs: the tokenizer and the encoded splits (+ raw valid text for BLEU)."""

    spm_bytes: bytes
    train: EncodedCorpus
    valid: EncodedCorpus | None
    valid_src_lines: list[str]
    valid_ref_lines: list[str]
    train_lines: tuple[list[str], list[str]] | None = None  # raw training text, kept for subword sampling

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """Parsed once: the validation of every checkpoint interval decodes with it."""
        return Tokenizer(self.spm_bytes)


def prepare_data(save_dir: Path, train_src: Path, train_tgt: Path, valid_src: Path | None,
                 valid_tgt: Path | None, vocab_size: int, max_len: int,
                 spm_bytes: bytes | None = None, write: bool = True, keep_train_text: bool = False
                 ) -> PreparedData:
    """Read, check, tokenize and cache. `spm_bytes` (a resumed run's tokenizer) is used
    as is, never retrained. With write=False (ranks other than 0) nothing is written.
    keep_train_text keeps the raw training lines (subword sampling re-encodes them)."""
    save_dir = Path(save_dir)
    cache = save_dir / CACHE_DIR
    train_pair = read_parallel(train_src, train_tgt)
    valid_pair = read_parallel(valid_src, valid_tgt) if valid_src else None
    spm_key = cache_key({"v": CACHE_VERSION, "files": file_fingerprint([train_src, train_tgt]),
                         "vocab_size": vocab_size})
    if spm_bytes is None:
        spm_bytes = _cached_spm(save_dir, spm_key, train_pair, vocab_size, write)
    elif write and (not (save_dir / SPM_FILE).is_file() or (save_dir / SPM_FILE).read_bytes() != spm_bytes):
        if (save_dir / SPM_FILE).is_file():  # damaged or replaced: the run's tokenizer is its checkpoints'
            log.warning("%s differs from the tokenizer the run's checkpoints hold; writing theirs back",
                        save_dir / SPM_FILE)
        with atomic_output(save_dir / SPM_FILE, "wb") as f:
            f.write(spm_bytes)
    tokenizer = Tokenizer(spm_bytes)
    spm_hash = hashlib.sha256(spm_bytes).hexdigest()[:20]

    def encoded(name: str, paths: list[Path], pair: tuple[list[str], list[str]]) -> EncodedCorpus:
        key = cache_key({"v": CACHE_VERSION, "files": file_fingerprint(paths), "spm": spm_hash,
                         "max_len": max_len})
        path = cache / f"{name}-{key}.pt"
        if path.is_file():
            try:
                cached = EncodedCorpus(**torch_load_verified(path))
                log.info("%s: using the encoded corpus cached in %s", name, path)
                return cached
            except CheckpointError as e:  # a damaged cache is only a cache: encode again
                log.warning("%s; encoding the corpus again", e)
        corpus = encode_and_filter(tokenizer, pair[0], pair[1], max_len, name, " and ".join(map(str, paths)))
        if write:
            for old in cache.glob(f"{name}-*.pt"):
                old.unlink()
            atomic_torch_save(corpus.to_dict(), path)
        return corpus

    train = encoded("train", [train_src, train_tgt], train_pair)
    valid = encoded("valid", [valid_src, valid_tgt], valid_pair) if valid_pair else None
    return PreparedData(spm_bytes, train, valid, *(valid_pair or ([], [])),
                        train_lines=train_pair if keep_train_text else None)


def _cached_spm(save_dir: Path, key: str, pair: tuple[list[str], list[str]], vocab_size: int,
                write: bool) -> bytes:
    """The save dir's spm.model when it was trained on these files with this vocab size,
    else a freshly trained one (written with its key)."""
    model_path, key_path = save_dir / SPM_FILE, save_dir / CACHE_DIR / "spm.key"
    if model_path.is_file() and key_path.is_file() and key_path.read_text().strip() == key:
        cached = model_path.read_bytes()
        try:
            Tokenizer(cached)
            log.info("using the cached SentencePiece model %s", model_path)
            return cached
        except TokenizerError as e:  # (it was this error, the file unnamed, on every rerun)
            if not write:
                raise UserError(f"{model_path}: {e}") from None
            log.warning("%s: %s; training it again", model_path, e)
    if not write:
        raise UserError(f"{model_path}: rank 0 did not leave the SentencePiece model here")
    spm_bytes = train_sentencepiece(pair[0] + pair[1], vocab_size)
    with atomic_output(model_path, "wb") as f:
        f.write(spm_bytes)
    with atomic_output(key_path) as f:
        f.write(key + "\n")
    return spm_bytes


# A training batch's piece ids (source, target) re-made from its sentence indices and a key
# (seed, epoch, batch number) that fixes any randomness: pipeline/corpus/sampling.py.
BatchEncoder = Callable[[np.ndarray, tuple[int, int, int]], tuple[list[Any], list[Any]]]


# -- batches ---------------------------------------------------------------------------

@dataclass
class Batch:
    src: Tensor  # (B, S) int64: pieces + EOS, padded
    tgt_in: Tensor  # (B, T): BOS + pieces
    tgt_out: Tensor  # (B, T): pieces + EOS
    n_tgt_tokens: int  # non-pad tokens of tgt_out (what the loss is normalised by)
    n_src_tokens: int

    def to(self, device: torch.device) -> Batch:
        return Batch(self.src.to(device, non_blocking=True), self.tgt_in.to(device, non_blocking=True),
                     self.tgt_out.to(device, non_blocking=True), self.n_tgt_tokens, self.n_src_tokens)


def make_batches(src_lens: np.ndarray, tgt_lens: np.ndarray, batch_tokens: int, seed: int,
                 epoch: int, bucket_size: int = 20000) -> list[np.ndarray]:
    """Sentence indices grouped into batches of at most `batch_tokens` padded tokens.

    Shuffle, cut into buckets of `bucket_size`, sort each bucket by length (so padding is
    small), pack greedily, then shuffle the batches: deterministic in (seed, epoch).
    A sentence longer than the budget on its own becomes a one-sentence batch.
    """
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(src_lens))
    sizes = np.maximum(src_lens, tgt_lens) + 1  # + EOS (source) / BOS or EOS (target)
    batches: list[np.ndarray] = []
    for start in range(0, len(order), bucket_size):
        bucket = order[start:start + bucket_size]
        bucket = bucket[np.lexsort((tgt_lens[bucket], src_lens[bucket]))]
        current: list[int] = []
        longest = 0
        for i in bucket:
            longest_if_added = max(longest, int(sizes[i]))
            if current and longest_if_added * (len(current) + 1) > batch_tokens:
                batches.append(np.asarray(current, dtype=np.int64))
                current, longest_if_added = [], int(sizes[i])
            current.append(int(i))
            longest = longest_if_added
        if current:
            batches.append(np.asarray(current, dtype=np.int64))
    return [batches[i] for i in rng.permutation(len(batches))]


def collate(corpus: EncodedCorpus, indices: np.ndarray) -> Batch:
    """Padded tensors for the given sentences: src + EOS; BOS + tgt; tgt + EOS."""
    return pad_batch([corpus.src(i) for i in indices], [corpus.tgt(i) for i in indices])


def pad_batch(src_seqs: Sequence[Sequence[int]], tgt_seqs: Sequence[Sequence[int]]) -> Batch:
    """Padded tensors of piece ids (without specials): src + EOS; BOS + tgt; tgt + EOS."""
    n = len(src_seqs)
    src_len = max(len(s) for s in src_seqs) + 1
    tgt_len = max(len(t) for t in tgt_seqs) + 1
    src = torch.full((n, src_len), PAD_ID, dtype=torch.int64)
    tgt_in = torch.full((n, tgt_len), PAD_ID, dtype=torch.int64)
    tgt_out = torch.full((n, tgt_len), PAD_ID, dtype=torch.int64)
    n_src = n_tgt = 0
    for row, (s_ids, t_ids) in enumerate(zip(src_seqs, tgt_seqs)):
        s, t = torch.as_tensor(np.asarray(s_ids, dtype=np.int64)), torch.as_tensor(np.asarray(t_ids, dtype=np.int64))
        src[row, :len(s)] = s
        src[row, len(s)] = EOS_ID
        tgt_in[row, 0] = BOS_ID
        tgt_in[row, 1:len(t) + 1] = t
        tgt_out[row, :len(t)] = t
        tgt_out[row, len(t)] = EOS_ID
        n_src += len(s) + 1
        n_tgt += len(t) + 1
    return Batch(src, tgt_in, tgt_out, n_tgt, n_src)


class ShardedBatches:
    """An endless, resumable stream of this rank's micro-batches, one group per update.

    Position = (epoch, next group index); identical on every rank, saved in checkpoints.
    """

    def __init__(self, corpus: EncodedCorpus, batch_tokens: int, seed: int, world_size: int,
                 rank: int, update_freq: int, sampler: BatchEncoder | None = None):
        self.corpus, self.batch_tokens, self.seed, self.sampler = corpus, batch_tokens, seed, sampler
        self.world_size, self.rank, self.update_freq = world_size, rank, update_freq
        self.group_size = world_size * update_freq
        self.epoch, self.group = 1, 0
        self._epoch_batches: list[np.ndarray] | None = None
        if self._n_groups(self._batches()) == 0:
            raise UserError(f"the training data makes {len(self._batches())} batches of --batch-tokens "
                            f"{batch_tokens}, fewer than one update needs ({self.group_size} = "
                            f"{world_size} processes x --update-freq {update_freq}); lower "
                            "--batch-tokens or --update-freq, or give more data")

    def _batches(self) -> list[np.ndarray]:
        if self._epoch_batches is None:
            self._epoch_batches = make_batches(self.corpus.src_lens, self.corpus.tgt_lens,
                                               self.batch_tokens, self.seed, self.epoch)
        return self._epoch_batches

    def _n_groups(self, batches: list[np.ndarray]) -> int:
        return len(batches) // self.group_size

    def next_group(self) -> list[Batch]:
        """This rank's `update_freq` micro-batches of the next update."""
        batches = self._batches()
        if self.group >= self._n_groups(batches):
            self.epoch, self.group, self._epoch_batches = self.epoch + 1, 0, None
            log.debug("epoch %d begins", self.epoch)
            batches = self._batches()
        start = self.group * self.group_size
        numbers = range(start + self.rank, start + self.group_size, self.world_size)
        self.group += 1
        if self.sampler is None:
            return [collate(self.corpus, batches[n]) for n in numbers]
        # Keyed by the batch's place in the epoch, not by rank: DDP shards see what one process sees.
        return [pad_batch(*self.sampler(batches[n], (self.seed, self.epoch, n))) for n in numbers]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "group": self.group, "group_size": self.group_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["group_size"] != self.group_size:
            saved = state["group_size"]
            fits = (f"; here: --update-freq {saved // self.world_size}" if saved % self.world_size == 0 else
                    f"; {self.world_size} processes cannot make it")  # the --update-freq that keeps the product
            raise UserError(f"the checkpoint was made with {saved} batches per update (processes x "
                            f"--update-freq), this run has {self.group_size} ({self.world_size} process(es) x "
                            f"--update-freq {self.update_freq}); resume with the same product so the data position "
                            f"means the same thing{fits}")
        self.epoch, self.group, self._epoch_batches = state["epoch"], state["group"], None


def iter_eval_batches(corpus: EncodedCorpus, batch_tokens: int) -> list[Batch]:
    """Validation batches in a fixed order (no shuffling; one epoch)."""
    return [collate(corpus, idx) for idx in make_batches(corpus.src_lens, corpus.tgt_lens,
                                                         batch_tokens, seed=0, epoch=0)]
