"""A vocabulary shortlist: the target ids a batch's decoder steps score, from its source ids.

`pipeline export --shortlist-src S --shortlist-tgt T` counts a lexical table from a parallel corpus,
tokenized as the model tokenizes (`build`): the `frequent` most frequent target pieces, and for each
source piece the `per_source` target pieces most often in the same sentence pair as it (ranked by
count, that is by p(t | s), among the pieces that are not frequent ones). It is stored in the model
dir (shortlist.npz, covered by the manifest).

A batch's candidates (`Shortlist.candidates`) are EOS, the frequent pieces and the lists of every
source piece in the batch: their union, EOS first, then ascending. The shortlisted decoder step
(decoder_shortlist.onnx, or the torch backend with the same table) projects onto those rows of the
tied embedding only and normalises its log-softmax over them, as Marian's lexical shortlists and
CTranslate2's vocabulary maps do. So a translation can depend on the sentences batched with it (the
union grows with the batch), and a token outside the union cannot be produced; `coverage` measures how
often that matters (parity reports it, gated by BLEU like a precision).

numpy only: the deploy path (ONNX Runtime, no torch) reads and applies it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.errors import RuntimeUserError

FORMAT = 1
DEFAULT_PER_SOURCE = 50
DEFAULT_FREQUENT = 100
CHUNK_PAIRS = 20_000  # sentence pairs counted at a time (bounds memory on large corpora)


class ShortlistError(RuntimeUserError):
    """A shortlist table that cannot be used with this model (wrong vocabulary, too few candidates)."""


@dataclass(frozen=True)
class Shortlist:
    """The lexical table: source id s lists targets[offsets[s]:offsets[s + 1]]; `frequent` is always in."""

    offsets: np.ndarray   # (vocab_size + 1,) int64
    targets: np.ndarray   # (entries,) int32, per source id ascending
    frequent: np.ndarray  # (F,) int32, ascending
    eos_id: int
    vocab_size: int

    def candidates(self, src_ids: np.ndarray) -> np.ndarray:
        """(C,) int64 candidates of a batch of source ids (any shape; padding may be included: its
        list is empty): EOS first, then the union of the frequent pieces and the sources' lists,
        ascending."""
        sources = np.unique(np.asarray(src_ids, dtype=np.int64))
        sources = sources[(sources >= 0) & (sources < self.vocab_size)]
        starts, ends = self.offsets[sources], self.offsets[sources + 1]
        lengths = ends - starts
        total = int(lengths.sum())
        # positions of every listed entry: each segment's start, plus 0..length-1 within it
        within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        listed = self.targets[np.repeat(starts, lengths) + within]
        union = np.union1d(self.frequent, listed).astype(np.int64)
        union = union[union != self.eos_id]
        return np.concatenate([np.array([self.eos_id], np.int64), union])

    def coverage(self, sources: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> tuple[int, int]:
        """(tokens of `outputs` inside their own sentence's candidates, all their tokens), EOS counted:
        how often a full-vocabulary choice falls inside the list. Per sentence, so a lower bound for
        batches, whose union is larger."""
        inside = total = 0
        for src, out in zip(sources, outputs):
            if not len(src):
                continue  # a blank line: nothing was decoded
            wanted = np.asarray(list(out) + [self.eos_id], dtype=np.int64)
            inside += int(np.isin(wanted, self.candidates(np.asarray(src))).sum())
            total += int(wanted.size)
        return inside, total

    def check(self, vocab_size: int, eos_id: int, topk: int, where: object) -> None:
        """Refuse a table made for another vocabulary, or one whose smallest candidate set is below top-k."""
        if self.vocab_size != vocab_size or self.eos_id != eos_id:
            raise ShortlistError(f"{where}: shortlist made for a vocabulary of {self.vocab_size} (EOS "
                                 f"{self.eos_id}), but the model has {vocab_size} (EOS {eos_id}); export again")
        smallest = 1 + int(np.count_nonzero(self.frequent != eos_id))
        if smallest < topk:
            raise ShortlistError(f"{where}: a batch may get only {smallest} candidates but the decoder step takes "
                                 f"its top {topk}; export again with --shortlist-frequent >= {topk}")

    def save(self, path: Path) -> Path:
        with open(path, "wb") as f:
            np.savez(f, format=np.int64(FORMAT), offsets=self.offsets, targets=self.targets, frequent=self.frequent,
                     eos_id=np.int64(self.eos_id), vocab_size=np.int64(self.vocab_size))
        return path

    @classmethod
    def load(cls, path: Path) -> Shortlist:
        try:
            with np.load(path, allow_pickle=False) as data:
                if int(data["format"]) != FORMAT:
                    raise ShortlistError(f"{path}: shortlist format {int(data['format'])}, this version reads "
                                         f"{FORMAT}; export the model again")
                table = cls(offsets=data["offsets"].astype(np.int64), targets=data["targets"].astype(np.int32),
                            frequent=data["frequent"].astype(np.int32), eos_id=int(data["eos_id"]),
                            vocab_size=int(data["vocab_size"]))
        except (OSError, KeyError, ValueError) as e:
            raise ShortlistError(f"{path}: not a readable shortlist ({e}); export the model again") from None
        if table.offsets.shape != (table.vocab_size + 1,) or int(table.offsets[-1]) != table.targets.size:
            raise ShortlistError(f"{path}: inconsistent shortlist table; export the model again")
        return table


def build(sources: Iterable[Sequence[int]], targets: Iterable[Sequence[int]], *, vocab_size: int, eos_id: int,
          exclude: Iterable[int] = (), per_source: int = DEFAULT_PER_SOURCE,
          frequent: int = DEFAULT_FREQUENT) -> tuple[Shortlist, int]:
    """The table from line-aligned source and target id sequences; also the number of pairs counted.

    `exclude`: ids never listed (padding, BOS, UNK, ids the model suppresses); EOS is always a
    candidate and never listed."""
    if per_source < 0 or frequent < 0:
        raise ShortlistError("--shortlist-per-source and --shortlist-frequent must be >= 0")
    banned = np.zeros(vocab_size, dtype=bool)
    banned[[i for i in exclude if 0 <= i < vocab_size]] = True
    banned[eos_id] = True
    target_counts = np.zeros(vocab_size, dtype=np.int64)
    source_counts = np.zeros(vocab_size, dtype=np.int64)
    merged_keys = np.zeros(0, dtype=np.int64)
    merged_counts = np.zeros(0, dtype=np.int64)
    pending: list[tuple[np.ndarray, np.ndarray]] = []
    n_pairs = 0
    for src, tgt in zip(sources, targets):
        s = np.unique(np.asarray(src, dtype=np.int64))
        t = np.unique(np.asarray(tgt, dtype=np.int64))
        s, t = s[~banned[s]], t[~banned[t]]
        np.add.at(target_counts, np.asarray(tgt, dtype=np.int64), 1)
        source_counts[s] += 1
        pending.append((s, t))
        n_pairs += 1
        if len(pending) == CHUNK_PAIRS:
            merged_keys, merged_counts = _merge(merged_keys, merged_counts, _pair_keys(pending, vocab_size))
            pending = []
    merged_keys, merged_counts = _merge(merged_keys, merged_counts, _pair_keys(pending, vocab_size))
    target_counts[banned] = 0
    # the most frequent target pieces (ties: the lower id), always candidates
    order = np.lexsort((np.arange(vocab_size), -target_counts))
    top = order[:frequent]
    top = np.sort(top[target_counts[top] > 0]).astype(np.int32)
    is_frequent = np.zeros(vocab_size, dtype=bool)
    is_frequent[top] = True
    src_of, tgt_of = merged_keys // vocab_size, merged_keys % vocab_size
    keep = ~is_frequent[tgt_of]
    src_of, tgt_of, counts = src_of[keep], tgt_of[keep], merged_counts[keep]
    # per source: the per_source targets seen with it most often (ties: the lower id)
    order = np.lexsort((tgt_of, -counts, src_of))
    src_of, tgt_of = src_of[order], tgt_of[order]
    group_start = np.searchsorted(src_of, src_of, side="left")
    chosen = (np.arange(src_of.size) - group_start) < per_source
    src_of, tgt_of = src_of[chosen], tgt_of[chosen]
    order = np.lexsort((tgt_of, src_of))  # each source's list ascending
    src_of, tgt_of = src_of[order], tgt_of[order]
    offsets = np.zeros(vocab_size + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(np.bincount(src_of, minlength=vocab_size))
    table = Shortlist(offsets=offsets, targets=tgt_of.astype(np.int32), frequent=top, eos_id=eos_id,
                      vocab_size=vocab_size)
    return table, n_pairs


def _pair_keys(pairs: list[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> np.ndarray:
    """source * vocab_size + target for every (source piece, target piece) of each sentence pair."""
    keys = [(s[:, None] * vocab_size + t[None, :]).ravel() for s, t in pairs if s.size and t.size]
    return np.concatenate(keys) if keys else np.zeros(0, dtype=np.int64)


def _merge(keys: np.ndarray, counts: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Counts per distinct key of `keys` (with `counts`) and `new` (each once)."""
    all_keys = np.concatenate([keys, new])
    weights = np.concatenate([counts, np.ones(new.size, dtype=np.int64)])
    distinct, inverse = np.unique(all_keys, return_inverse=True)
    return distinct, np.bincount(inverse, weights=weights, minlength=distinct.size).astype(np.int64)
