"""The one interface beam and greedy search run against, whatever executes the model.

A backend owns the encoder output and the decoder caches in its native form (numpy arrays
for ONNX Runtime on the CPU, torch tensors for PyTorch and TensorRT); search only sees
the step's candidates as numpy arrays on the host, and hands back row indices as numpy
int64 arrays. So search, batching and the ONNX Runtime CPU path never import torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from model import io_names
from model.cache import BeamCache, keep_rows
from model.manifest import DEFAULT_TOPK  # noqa: F401 (re-exported)
from runtime.errors import RuntimeUserError

# DEFAULT_TOPK: candidates per step of a torch backend made from a checkpoint, as export's default


@dataclass
class EncoderState:
    """What decoding needs from the source: per-layer cross K/V and the source bias.

    `tensors` maps io_names (cross_k.i, cross_v.i, src_bias) to backend-native arrays
    with one row per sentence; a step's N hypotheses are N / n_rows consecutive rows per
    sentence, which share that sentence's row (no per-beam copies).
    """

    tensors: dict[str, Any]
    n_rows: int
    # with a vocabulary shortlist (runtime/shortlist.py): the batch's candidate target ids, (C,) int64 in
    # the backend's array type; kept as the batch's sentences finish
    candidates: Any = None
    # what a backend sets up once for this state's steps (ONNX Runtime: its IO binding, with
    # these tensors bound once; the torch backend's fixed-shape step: the static batch its sentences
    # live in, which a selected state keeps); an ONNX Runtime state selected starts without it
    bound: Any = field(default=None, repr=False, compare=False)


@dataclass
class StepOutput:
    """Candidates of one decoder step, as numpy arrays on the host."""

    topk_log_probs: np.ndarray  # (N, K) float32, sorted descending
    topk_ids: np.ndarray        # (N, K) int64
    eos_log_probs: np.ndarray   # (N,) float32
    # with `want` given to step: (N, W) float32, each row's log-probs of the ids it asked for (any id of the
    # vocabulary, inside its top-K or not; -inf where it asked for -1). Constrained search (glossaries) needs
    # the log-probs of a term's next token even where the model would not choose it.
    want_log_probs: np.ndarray | None = None


class Backend(Protocol):
    name: str
    cfg: Any              # the model's ModelConfig: shapes and special ids (search reads pad, bos, eos)
    device: Any           # where the backend runs (str or torch.device), for reports
    precision: str        # what it computes in: the exported graphs' or engines' (fp32, fp16, int8); torch its dtype's
    topk: int             # K of the step's candidates; beam search needs 2 * beam <= K
    max_src_len: int      # longest source (tokens, EOS included) this backend accepts
    max_tgt_len: int      # decoder positions available: BOS + generated tokens incl. EOS
    shortlist: Any        # runtime.shortlist.Shortlist the steps score over, or None (the whole vocabulary)
    gathers: bool         # whether step takes `want` (the ids whose log-probs constrained search needs)

    @property
    def max_batch(self) -> int | None:
        """Most sentences a batch may hold (a TensorRT engine's profile); None: any."""

    @property
    def parallel_batches(self) -> int:
        """Batches decoded at once (the onnxruntime backend on the CPU: --parallel-batches); 1 elsewhere."""

    @property
    def step_mode(self) -> str | None:
        """The torch backend's decoder step (eager, graph, compiled: --step); None for an engine's own."""

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling decoder steps so far (--step compiled); 0 elsewhere."""

    def search_on_device(self, src_ids: np.ndarray, options: Any, first_tokens: Any = None) -> Any:
        """The whole beam search of a batch run on the device (the torch backend's --steps-per-replay:
        runtime/device_search.py), as search.py's list of hypotheses per sentence; None where this backend
        does not (then search runs here, step by step)."""

    def encode(self, src_ids: np.ndarray) -> EncoderState:
        """src_ids (B, S) int64 padded with cfg.pad_id -> state with B rows."""

    def select(self, state: EncoderState, rows: np.ndarray) -> EncoderState:
        """A state whose row i is `state`'s row rows[i] (drops finished sentences); `state` is given up."""

    def initial_cache(self, n_rows: int) -> Any:
        """An empty self-attention cache for n_rows hypotheses (model.cache.BeamCache for
        the real backends; opaque to search)."""

    def step(self, state: EncoderState, tokens: np.ndarray, step: int, cache: Any,
             reorder: np.ndarray, want: np.ndarray | None = None) -> tuple[StepOutput, Any]:
        """One decoder step. tokens (N,) int64 with N a multiple of state.n_rows (rows of
        a sentence are consecutive); reorder (N,) int64 rows of `cache` each hypothesis
        continues (within its own sentence); returns the candidates and the cache with
        this step added (the real backends extend it in place). want (N, W) int64, only to a
        backend that `gathers`: per row, ids (-1: none) whose log-probs StepOutput.want_log_probs
        returns, from the same log-softmax as the top-K."""


def select_rows(state: EncoderState, rows: np.ndarray) -> EncoderState:
    """`Backend.select` for numpy or torch state tensors: row i of the result is row rows[i]
    of every tensor. `state` is given up: its numpy tensors' rows are moved in place where they can be
    (model.cache.moves_in_place: search's tail_filled order), which spares a batch's every drop a copy of its
    cross K/V and moves only as many rows as finished."""
    rows = np.asarray(rows, dtype=np.int64)
    moved: dict[str, Any] = {}
    arrays = {name: v for name, v in state.tensors.items() if isinstance(v, np.ndarray)}
    if arrays:  # finished sentences leave: the live ones move in place, as in the cache, all in one pass
        if len({v.shape[0] for v in arrays.values()}) == 1:
            moved.update(zip(arrays, keep_rows(list(arrays.values()), rows)))
        else:
            moved.update({name: np.take(v, rows, axis=0) for name, v in arrays.items()})
    index: Any = None
    selected: dict[str, Any] = {}
    for name, v in state.tensors.items():
        if name in moved:
            selected[name] = moved[name]
            continue
        if index is None:  # a torch tensor (torch and TensorRT backends, ONNX Runtime on CUDA)
            import torch

            index = torch.from_numpy(rows).to(v.device)
        selected[name] = v.index_select(0, index)
    return EncoderState(selected, int(rows.shape[0]), candidates=state.candidates)


def host(x: Any, dtype: Any = None) -> np.ndarray:
    """A numpy array on the host from a numpy array or a torch tensor on any device."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


class ExportedGraphBackend:
    """What the onnxruntime and tensorrt backends share: state and caches laid out as the
    exported graphs take them. Subclasses set cfg, device, cache_dtype, max_tgt_len."""

    cfg: Any
    device: Any
    cache_dtype: Any
    max_tgt_len: int
    precision: str = "fp32"  # the model dir's (the graphs and engines were exported in it)
    shortlist: Any = None
    max_batch: int | None = None
    parallel_batches = 1
    step_mode: str | None = None
    compile_seconds = 0.0

    def select(self, state: EncoderState, rows: np.ndarray) -> EncoderState:
        return select_rows(state, rows)

    def search_on_device(self, src_ids: np.ndarray, options: Any, first_tokens: Any = None) -> None:
        return None  # the engines run one step per call; search drives them

    @staticmethod
    def check_decoder_inputs(inputs: Iterable[str], where: object) -> None:
        """Refuse, with the way out, a decoder built before the beam cache (model/cache.py):
        its inputs have a `reorder` instead of the ancestry index, so binding would fail at the
        first step with an engine's message instead."""
        if not {io_names.SELF_INDEX, io_names.CACHE_INDIRECTION} & set(inputs):
            raise RuntimeUserError(f"{where} has an older decoder interface (no `{io_names.SELF_INDEX}` input: "
                                   "exported before the beam cache); export the model again with `pipeline export`")

    @staticmethod
    def check_encoder_outputs(outputs: dict[str, Any], cfg: Any, where: object) -> None:
        """Refuse a manifest whose model_config the encoder graph contradicts (its decoder layers' cross K/V:
        layers, heads, head size): the manifest is the one file of a model dir no digest covers, and an edited one
        failed at the first batch with an engine's KeyError or shape error."""
        k = outputs.get(io_names.cross_k(0))
        shape = list(k) if k is not None else []
        layers = 0
        while io_names.cross_k(layers) in outputs:
            layers += 1
        found = {"n_dec_layers": layers}
        if len(shape) == 4 and all(isinstance(d, int) for d in (shape[1], shape[3])):
            found |= {"n_heads": shape[1], "d_model": shape[1] * shape[3]}
        wrong = [f"model_config.{key} is {getattr(cfg, key)}, the graph's {value}" for key, value in found.items()
                 if getattr(cfg, key) != value]
        if wrong:
            raise RuntimeUserError(f"{where}: {'; '.join(wrong)} (manifest.json was edited, or comes from another "
                                   "export); export the model again with `pipeline export`")

    def initial_cache(self, n_rows: int) -> BeamCache:
        return BeamCache(self.cfg, n_rows, self.cache_dtype, self.device, max_steps=self.max_tgt_len)
