"""The PyTorch backend: the checkpoint's model running the same incremental step that
the ONNX graphs were exported from (model.Transformer.decode_step).

On a CUDA device the step runs on fixed shapes and is replayed as a CUDA graph
(runtime/static_step.py), unless a vocabulary shortlist is used (its candidates change shape
with every batch), `step_mode="eager"` asks otherwise, or the environment sets
PIPELINE_CUDA_GRAPHS=0 (every command's switch, docs/gpu.md)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from model import io_names
from model.cache import BeamCache
from model.manifest import CHECKPOINT_FILE
from model.transformer import Transformer, select_candidates
from runtime.backend import DEFAULT_TOPK, EncoderState, StepOutput, host, select_rows
from runtime.decoding import DecodingOptions
from runtime.device_search import DeviceSearch
from runtime.errors import RuntimeUserError
from runtime.registry import resolve_device
from runtime.search import Hypothesis
from runtime.shortlist import Shortlist
from runtime.static_step import StaticBatch, StaticCache, StaticStepRunner
from runtime.tokenizer import AnyTokenizer, load_tokenizer

if TYPE_CHECKING:
    from runtime.model_dir import LoadOptions, ModelDir

log = logging.getLogger(__name__)

# static: the graph's fixed shapes without capture (CPU tests); compiled: the same body through torch.compile,
# captured as a CUDA graph on CUDA (runtime/static_step.py)
STEP_MODES = ("eager", "static", "graph", "compiled")
CUDA_GRAPHS_ENV = "PIPELINE_CUDA_GRAPHS"
DEFAULT_STEPS_PER_REPLAY = 4  # beam search steps per CUDA graph replay where the step is captured


def default_step_mode(device: torch.device, shortlist: Any, environ: Mapping[str, str] = os.environ) -> str:
    """graph on CUDA without a shortlist, unless PIPELINE_CUDA_GRAPHS is 0 (or false, no, off); else eager."""
    off = environ.get(CUDA_GRAPHS_ENV, "1").strip().lower() in ("0", "false", "no", "off")
    return "graph" if device.type == "cuda" and shortlist is None and not off else "eager"


def prepare_for_inference(model: Transformer) -> None:
    """Fewer kernels per decoder step, the same arithmetic: each decoder self-attention's q, k and v
    projections become one GEMM (MultiHeadAttention.fuse_qkv_), and in half precision the LayerNorms
    keep fp32 parameters (they compute in fp32 and would cast their fp16 parameters at every call: the
    same values, 36 copy kernels per base step). Changes the model in place; not for one being trained."""
    for layer in model.decoder:
        layer.self_attn.fuse_qkv_()
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm) and m.weight.dtype != torch.float32:
            m.float()


class TorchBackend:
    name = "torch"
    max_batch: int | None = None  # any batch: no engine profile
    parallel_batches = 1

    def __init__(self, model: Transformer, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, topk: int = DEFAULT_TOPK,
                 max_src_len: int | None = None, max_tgt_len: int | None = None, shortlist: Shortlist | None = None,
                 step_mode: str | None = None, fuse: bool = True, steps_per_replay: int | None = None):
        self.device = torch.device(device)
        self.dtype = dtype
        self.precision = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32")  # model.pt's, cast
        self.model = model.to(self.device, dtype=dtype).eval()
        if fuse:  # an inference model: fewer kernels per decoder step, the same arithmetic
            prepare_for_inference(self.model)
        self.cfg = model.cfg
        self.topk = topk
        self.max_src_len = max_src_len or self.cfg.max_positions
        self.max_tgt_len = max_tgt_len or self.cfg.max_positions
        self.shortlist = shortlist  # each batch's steps score its candidates only
        if shortlist is not None:
            shortlist.check(self.cfg.vocab_size, self.cfg.eos_id, topk, "--shortlist")
        if step_mode is None:
            step_mode = default_step_mode(self.device, shortlist)
        if step_mode not in STEP_MODES:
            raise ValueError(f"step mode {step_mode!r}: choose one of {', '.join(STEP_MODES)}")
        if step_mode != "eager" and shortlist is not None:
            raise ValueError("a vocabulary shortlist needs the eager step (its candidates change with the batch)")
        self.step_mode = step_mode
        # the eager step computes every id's log-prob, so it hands out any of them (constrained search); the
        # fixed-shape step returns its top-K only, and a shortlisted one scores its candidates only
        self.gathers = step_mode == "eager" and shortlist is None
        capture = step_mode == "graph" or (step_mode == "compiled" and self.device.type == "cuda")
        self.static = None if step_mode == "eager" else StaticStepRunner(
            self.model, topk, dtype, self.device, capture=capture, compiled=step_mode == "compiled")
        if steps_per_replay is None:  # on an H200 (docs/gpu.md): 1.03-1.34x the one-step graph at fixed lengths
            steps_per_replay = DEFAULT_STEPS_PER_REPLAY if capture else 1
        if steps_per_replay < 1:
            raise ValueError(f"steps per replay must be at least 1, got {steps_per_replay}")
        if steps_per_replay > 1 and self.static is None:
            raise ValueError("several steps per replay need a fixed-shape step (--step graph or compiled), not eager")
        self.steps_per_replay = steps_per_replay
        # beam search on the device, steps_per_replay steps per replay (runtime/device_search.py)
        self.device_search = None if steps_per_replay == 1 or self.static is None else DeviceSearch(
            self.static, steps_per_replay, compiled=step_mode == "compiled")

    @property
    def compile_seconds(self) -> float:
        """torch.compile's time so far, over every batch shape (--step compiled; 0 for the other steps)."""
        spent = sum(self.static.compile_seconds.values()) if self.static is not None else 0.0
        return spent + (self.device_search.compile_seconds if self.device_search is not None else 0.0)

    def search_on_device(self, src_ids: np.ndarray, options: DecodingOptions,
                         first_tokens: Any = None) -> list[list[Hypothesis]] | None:
        if self.device_search is None or not DeviceSearch.supports(options, first_tokens):
            return None
        with torch.inference_mode():
            return self.device_search.search(self, src_ids, options)

    @torch.inference_mode()
    def encode(self, src_ids: Any) -> EncoderState:
        src_ids = torch.as_tensor(src_ids, dtype=torch.int64)
        memory, src_bias = self.model.encode(src_ids.to(self.device))
        ks, vs = self.model.cross_kv(memory)
        tensors: dict[str, Any] = {io_names.SRC_BIAS: src_bias}
        for i, (k, v) in enumerate(zip(ks, vs)):
            tensors[io_names.cross_k(i)] = k
            tensors[io_names.cross_v(i)] = v
        candidates = None
        if self.shortlist is not None:
            candidates = torch.from_numpy(self.shortlist.candidates(src_ids.numpy())).to(self.device)
        return EncoderState(tensors, src_ids.shape[0], candidates=candidates)

    def select(self, state: EncoderState, rows: np.ndarray) -> EncoderState:
        if isinstance(state.bound, StaticBatch):  # its sentences keep their static slots (the cache maps them)
            return EncoderState({}, int(np.asarray(rows).shape[0]), bound=state.bound)
        return select_rows(state, rows)

    def initial_cache(self, n_rows: int) -> BeamCache:
        if self.static is not None:
            return self.static.cache(n_rows, self.max_tgt_len)
        return BeamCache(self.cfg, n_rows, self.dtype, self.device, max_steps=self.max_tgt_len)

    @torch.inference_mode()
    def step(self, state: EncoderState, tokens: Any, step: int, cache: BeamCache,
             reorder: Any, want: Any = None) -> tuple[StepOutput, BeamCache]:
        if want is not None:
            want = self._want(want, len(tokens))
        if isinstance(cache, StaticCache) and self.static is not None:
            out, cache = self.static.step(state, tokens, step, cache, reorder)
            state.bound = cache.batch
            return out, cache
        n = self.cfg.n_dec_layers
        t = state.tensors
        feeds = cache.advance(reorder, state.n_rows)
        log_probs, step_k, step_v = self.model.decode_step(
            torch.as_tensor(tokens, dtype=torch.int64).to(self.device), torch.tensor([step], device=self.device),
            feeds[io_names.SELF_INDEX], feeds[io_names.SELF_BIAS], cache.k, cache.v,
            [t[io_names.cross_k(i)] for i in range(n)], [t[io_names.cross_v(i)] for i in range(n)],
            t[io_names.SRC_BIAS], state.candidates)
        cache.append(step_k, step_v)
        top_lp, top_ids, eos_lp = select_candidates(log_probs, self.topk, self.cfg.eos_id, state.candidates)
        want_lp = None
        if want is not None:  # any id's log-prob, -inf for -1 (what decoder_constrained.onnx computes)
            want_lp = host(torch.where(want < 0, float("-inf"), log_probs.float().gather(1, want.clamp(min=0))))
        return StepOutput(host(top_lp), host(top_ids), host(eos_lp), want_lp), cache

    def _want(self, want: Any, n: int) -> torch.Tensor:
        """`want` as an (n, W) int64 tensor on the device; RuntimeUserError where this backend does not gather."""
        if not self.gathers:
            raise RuntimeUserError(
                "glossaries need the log-probs of a term's tokens over the whole vocabulary: the torch backend "
                + ("computes them with --shortlist only over its candidates: serve without --shortlist"
                   if self.shortlist is not None else
                   f"returns them only from its eager step, not --step {self.step_mode}: use --step eager"))
        t = torch.as_tensor(want, dtype=torch.int64, device=self.device)
        if t.dim() != 2 or t.shape[0] != n:
            raise ValueError(f"want must be (hypotheses, ids) = ({n}, W), got shape {tuple(t.shape)}")
        return t


def torch_dtype(precision: str | None, device: torch.device) -> torch.dtype:
    """fp16 only on a GPU (CPU half matmuls are slow and not what the graphs compute)."""
    if precision == "fp16" and device.type == "cuda":
        return torch.float16
    if precision == "fp16":
        log.warning("fp16 asked for on %s: running the PyTorch model in fp32", device)
    if precision == "int8":
        log.warning("int8 model dir on the torch backend: running the fp32 weights of %s "
                    "(the int8 weights are in the ONNX graphs)", CHECKPOINT_FILE)
    return torch.float32


def open_model_dir(model_dir: ModelDir, options: LoadOptions, shortlist: Shortlist | None) -> TorchBackend:
    """The registry's opener (runtime/registry.py): the dir's model.pt on options.device."""
    from model.checkpoint import load_model

    dev = resolve_device(options.device)
    step = options.step
    if options.steps_per_replay is not None and options.steps_per_replay > 1 and step is None:
        if dev.type != "cuda":
            raise RuntimeUserError(f"--steps-per-replay {options.steps_per_replay} runs beam search in a CUDA graph: "
                                   f"on {dev} it needs --step compiled (slower than the default step there)")
        step = "graph"
    if options.threads:
        torch.set_num_threads(options.threads)
    manifest = model_dir.manifest
    model, _, _ = load_model(model_dir.file(CHECKPOINT_FILE), device="cpu")
    if options.step == "graph" and dev.type != "cuda":
        raise RuntimeUserError(f"--step graph replays CUDA graphs: it needs a CUDA device, not {dev}; use --step "
                               "compiled or eager on the CPU")
    if step not in (None, "eager") and shortlist is not None:
        raise RuntimeUserError(f"--step {step} runs fixed shapes; --shortlist changes them with every batch: "
                               "use one or the other")
    return TorchBackend(model, dev, torch_dtype(options.precision or manifest.precision, dev), topk=manifest.topk,
                        max_src_len=manifest.limits.max_src_len, max_tgt_len=manifest.limits.max_tgt_len,
                        shortlist=shortlist, step_mode=step, steps_per_replay=options.steps_per_replay)


def open_checkpoint(path: str | Path, device: str | None = None, topk: int = DEFAULT_TOPK,
                    threads: int | None = None) -> tuple[TorchBackend, AnyTokenizer]:
    """The PyTorch model straight from a checkpoint file or a training save dir (its averaged or latest
    checkpoint), with the tokenizer the checkpoint carries: what tune-decoding and the tests decode with where
    there is no model dir, on `threads` intra-op threads as a model dir's load takes them (None: torch's
    default). A model dir goes through runtime/model_dir.py's load."""
    from model.checkpoint import load_model, resolve_checkpoint

    if threads:
        torch.set_num_threads(threads)

    model, spm_bytes, _ = load_model(resolve_checkpoint(Path(path)), device="cpu")
    return TorchBackend(model, resolve_device(device), topk=topk), load_tokenizer(spm_bytes)
