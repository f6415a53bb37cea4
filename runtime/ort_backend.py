"""The ONNX Runtime backend: the exported encoder and decoder-step graphs.

Every input and output is bound by pointer through IO binding: numpy arrays on the CPU
(this path never imports torch), torch CUDA tensors on a GPU. Caches and cross K/V never
leave the device, and the beam's cache is written in place and never reordered (model/cache.py).
The decoder's binding is made once per encoder state: its tensors, the outputs and the tokens /
step buffers stay bound across the state's steps, and a step rebinds only what changed.

Session options: full graph optimisation and, by default, no intra-op thread spinning:
with several sessions (or processes) sharing few cores, spinning threads steal the
cores the working ones need.

int8 model dirs (int8 QDQ weights): ONNX Runtime fuses DequantizeLinear -> MatMul into
MatMulNBits at load; accuracy level 4 makes it quantize activations and run int8 GEMMs
where the CPU has VNNI / AMX / dot-product instructions, level 1 (fp32 GEMM on dequantized
weights) elsewhere, where level 4 measured much less accurate (runtime/cpu_int8.py).
"""

from __future__ import annotations

import functools
import logging
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from model import io_names
from model.digests import file_digest
from model.manifest import ROWWISE, Manifest
from runtime.backend import EncoderState, ExportedGraphBackend, StepOutput, host
from runtime.cpu_int8 import graph_as_is, int8_session_config, session_graph, wants_unsigned_weights
from runtime.errors import RuntimeUserError
from runtime.graph_cache import cached_session, entry_key
from runtime.heap import release_free_memory
from runtime.indirect_cache import IndirectCache
from runtime.machine import CPU_EP, CUDA_EP, TRT_EP, default_parallel_batches, usable_cores
from runtime.ort_binding import StepBinding
from runtime.ort_constrained import ConstrainedDecoder, want_array, why_not
from runtime.ort_setup import (
    choose_providers,
    default_device,
    disabled_optimizers,
    import_onnxruntime,
    import_torch_for_cuda,
    loading_graph,
    tensorrt_loadable,
)
from runtime.shortlist import Shortlist

if TYPE_CHECKING:  # annotations only; imported at run time by import_onnxruntime()
    import onnxruntime as ort

    from runtime.model_dir import LoadOptions, ModelDir

log = logging.getLogger(__name__)


_ORT_TYPES: dict[str, np.dtype[Any]] = {"tensor(float)": np.dtype(np.float32), "tensor(float16)": np.dtype(np.float16),
              "tensor(int64)": np.dtype(np.int64)}


def session_config(manifest: Manifest) -> dict[str, str]:
    """Session config entries the model dir's precision needs (int8: per this CPU, runtime/cpu_int8.py)."""
    return int8_session_config() if manifest.precision == "int8" else {}


class OrtBackend(ExportedGraphBackend):
    """Encoder + decoder-step ONNX graphs run by onnxruntime, IO-bound to numpy arrays (CPU) or torch tensors (CUDA)."""

    name = "onnxruntime"

    def __init__(self, model_dir: Path, manifest: Manifest, device: Any = None,
                 threads: int | None = None, spinning: bool = False,
                 providers: list[str] | None = None, shortlist: Shortlist | None = None,
                 parallel_batches: int = 1):
        import_onnxruntime()
        import onnxruntime as ort

        self.cfg, self.precision = manifest.model_config, manifest.precision
        available: list[str] = ort.get_available_providers()
        device = default_device(device)
        self.on_cuda = str(device).startswith("cuda")
        if parallel_batches > 1 and self.on_cuda:
            raise RuntimeUserError(f"--parallel-batches {parallel_batches} is for the CPU: on {device} the "
                                   "onnxruntime backend runs one batch at a time (make batches larger instead: "
                                   "--batch-tokens)")
        if self.on_cuda:  # device buffers are torch CUDA tensors (onnxruntime-gpu + PyTorch)
            torch = import_torch_for_cuda()
            self.device: Any = torch.device(device)
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        elif str(device) == "cpu":
            self.device = "cpu"
        else:
            raise RuntimeUserError(f"--device {device}: the onnxruntime backend runs on cpu or cuda[:N]")
        # batches that runtime.translate may decode at once on threads: sessions run concurrently (each
        # batch has its own binding and cache), and a run releases the GIL
        self.parallel_batches = parallel_batches
        self.providers = providers or choose_providers(
            self.device, available, use_tensorrt=self.on_cuda and TRT_EP in available and tensorrt_loadable())
        config = session_config(manifest)

        def options() -> ort.SessionOptions:
            opts = ort.SessionOptions()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            opts.intra_op_num_threads = threads or 0
            opts.inter_op_num_threads = 1
            opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
            opts.log_severity_level = 3
            # ONNX Runtime's BFC arena stays on, on the CPU too: the step's largest tensors are the
            # gathered cache histories (model/cache.py), a little larger every step, and without the
            # arena glibc would map and page-fault each one fresh (docs/design.md).
            for key, value in config.items():
                opts.add_session_config_entry(key, value)
            return opts

        provider_args = [self._provider_options(p, manifest) for p in self.providers]
        model_dir = Path(model_dir)
        # rowwise on the CPU: integer-matmul weights in the form this CPU multiplies fastest and
        # exactly (int8; uint8 for full-range weights without int8 dot products), flipped when
        # loading if stored otherwise. Pair-bounded ones (current exports) load as stored everywhere.
        pair_bounded = manifest.pair_bounded_weights
        flip = (manifest.quantization == ROWWISE and not self.on_cuda
                and manifest.unsigned_weights != wants_unsigned_weights(pair_bounded=pair_bounded))
        graph = functools.partial(session_graph, pair_bounded=pair_bounded) if flip else graph_as_is
        if flip and not manifest.unsigned_weights:
            log.info("%s: full-range int8 weights (exported before pair-bounded ones), loaded as uint8 for the exact "
                     "but slower u8 x u8 kernel on this CPU without int8 dot products; export the model again "
                     "for pair-bounded weights and the faster u8 x s8 kernel (docs/int8.md)", model_dir)
        # with a shortlist, the decoder step over candidates (decoder_shortlist.onnx, the same weights)
        self.shortlist = shortlist
        decoder_file = io_names.DECODER_SHORTLIST_FILE if shortlist is not None else io_names.DECODER_FILE
        disabled = disabled_optimizers(self.providers)

        def create(model: str, opts: ort.SessionOptions) -> ort.InferenceSession:
            return ort.InferenceSession(model, opts, providers=self.providers, provider_options=provider_args,
                                        disabled_optimizers=disabled)

        @functools.cache
        def weights() -> dict[str, str]:
            """The dir's weight files by their digests as they are (remembered as the manifest check's are),
            taken once for both graphs."""
            return {f.name: file_digest(f) for f in sorted(model_dir.glob("*.data")) if f.is_file()}

        def session(path: Path) -> ort.InferenceSession:
            with loading_graph(path):
                if flip or self.providers != [CPU_EP]:  # optimised graphs are remembered for the CPU only
                    with graph(path) as model:
                        return create(model, options())
                key = entry_key(file_digest(path), weights(), ort.__version__, self.providers,
                                {**config, "disabled_optimizers": ",".join(disabled)})
                return cached_session(path, key, create, options, ort)

        self.encoder = session(model_dir / io_names.ENCODER_FILE)
        self.decoder = session(model_dir / decoder_file)
        self.check_decoder_inputs((i.name for i in self.decoder.get_inputs()), model_dir / decoder_file)
        self.check_encoder_outputs({o.name: o.shape for o in self.encoder.get_outputs()}, self.cfg,
                                   model_dir / io_names.ENCODER_FILE)
        self.providers = list(self.decoder.get_providers())  # what onnxruntime actually enabled
        self.out_types: dict[str, np.dtype[Any]] = {o.name: _ORT_TYPES[o.type] for s in (self.encoder, self.decoder)
                          for o in s.get_outputs()}
        self.out_types[io_names.WANT_LOG_PROBS] = np.dtype(np.float32)
        # decoder_constrained.onnx (runtime/ort_constrained.py): opened on the first step given `want`
        self.constrained = ConstrainedDecoder(functools.partial(session, model_dir / io_names.DECODER_CONSTRAINED_FILE),
                                              why_not(model_dir, manifest, shortlisted=shortlist is not None))
        self.gathers = self.constrained.gathers
        # a decoder with DecoderMaskedMultiHeadAttention keeps a cache per hypothesis (export/self_attention.py)
        self.indirect = io_names.CACHE_INDIRECTION in {i.name for i in self.decoder.get_inputs()}
        if self.indirect and self.on_cuda:
            raise RuntimeUserError(f"{model_dir}'s int8 decoder runs on the CPU only: use --device cpu")
        self.cache_dtype: Any = np.float32 if self.indirect else self._array_dtype(self.out_types[io_names.step_k(0)])
        self.topk = manifest.topk
        self._follows_beam: dict[ort.InferenceSession, bool] = {}  # per decoder session (_candidates)
        if shortlist is not None:
            shortlist.check(self.cfg.vocab_size, self.cfg.eos_id, self.topk, model_dir / io_names.SHORTLIST_FILE)
        self.max_src_len = manifest.limits.max_src_len
        self.max_tgt_len = manifest.limits.max_tgt_len
        self.max_batch = None  # dynamic shapes: no engine profile to respect
        # The encoder's arena is released after each batch's encoding (CPU): kept, its
        # high-water mark (an activation per layer of the whole batch) stays resident through
        # all the decoding that follows. base rowwise int8, batch 32, beam 4, 30 tokens:
        # peak RSS 569-613 MB against 621-661 without, at the same speed (the encoder
        # runs once per batch; the decoder's arena is kept, see above).
        self._encoder_run_options = ort.RunOptions()
        if not self.on_cuda:
            self._encoder_run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
            # its default, said: absent, ONNX Runtime's Python run raises and catches a C++ exception (~40 us)
            self._encoder_run_options.add_run_config_entry("gpu_graph_id", "0")
        self._device_type = "cuda" if self.on_cuda else "cpu"
        self._device_id = (self.device.index or 0) if self.on_cuda else 0
        log.info("onnxruntime %s on %s with %s", ort.__version__, self.device, ", ".join(self.providers))

    def _provider_options(self, provider: str, manifest: Manifest) -> dict[str, Any]:
        device_id = (self.device.index or 0) if self.on_cuda else 0
        if provider == CUDA_EP:
            return {"device_id": device_id}
        if provider == TRT_EP:
            cache = Path.home() / ".cache" / "pipeline" / "ort-trt"
            cache.mkdir(parents=True, exist_ok=True)
            return {"device_id": device_id, "trt_engine_cache_enable": True,
                    "trt_engine_cache_path": str(cache),
                    "trt_fp16_enable": manifest.precision == "fp16"}
        return {}

    # -- IO binding ---------------------------------------------------------------------

    def _array_dtype(self, dtype: np.dtype[Any]) -> Any:
        """The array dtype of this backend's buffers: numpy's on the CPU, torch's on CUDA."""
        if not self.on_cuda:
            return dtype
        import torch

        return getattr(torch, dtype.name)

    def _bind_in(self, binding: ort.IOBinding, name: str, a: Any) -> Any:
        """Bind `a` by pointer; returns the array bound (a contiguous copy where `a` is not
        contiguous), which must stay referenced until the run."""
        if isinstance(a, np.ndarray):  # wrapped where it is, not copied: a quarter of bind_input's cost
            a = np.ascontiguousarray(a)
            binding.bind_cpu_input(name, a)
            return a
        a = a.contiguous()  # a torch CUDA tensor
        binding.bind_input(name, self._device_type, self._device_id, np.dtype(str(a.dtype)[6:]).type,
                           list(a.shape), a.data_ptr())
        return a

    def _bind_out(self, binding: ort.IOBinding, name: str, shape: tuple[int, ...], into: Any = None) -> Any:
        """Output `name` bound to a new array of `shape` (a CUDA tensor on the GPU), or on the CPU to `into`, a
        contiguous numpy array of that shape and the output's dtype."""
        dtype = self.out_types[name]
        if not self.on_cuda:
            a = np.empty(shape, dtype=dtype) if into is None else into
            binding.bind_output(name, "cpu", 0, dtype.type, list(shape), a.ctypes.data)
            return a
        import torch

        t = torch.empty(shape, dtype=self._array_dtype(dtype), device=self.device)
        binding.bind_output(name, self._device_type, self._device_id, dtype.type, list(shape), t.data_ptr())
        return t

    def _device_array(self, a: np.ndarray) -> Any:
        """A host array as an input of this backend (a CUDA tensor on the GPU)."""
        if not self.on_cuda:
            return a
        import torch

        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _run(self, session: ort.InferenceSession, binding: ort.IOBinding,
             run_options: ort.RunOptions | None = None) -> None:
        if self.on_cuda:
            import torch

            torch.cuda.current_stream(self.device).synchronize()  # inputs written by torch
        session.run_with_iobinding(binding, run_options)

    # -- Backend protocol ---------------------------------------------------------------

    def encode(self, src_ids: Any) -> EncoderState:
        if not self.on_cuda:  # a new batch: the last one's memory is free, hand it back (runtime/heap.py)
            release_free_memory()
        src_ids = self._device_array(host(src_ids, np.int64))
        b, s = src_ids.shape
        binding = self.encoder.io_binding()
        src_ids = self._bind_in(binding, io_names.SRC_IDS, src_ids)  # referenced until the run has read it
        cross = (b, self.cfg.n_heads, s, self.cfg.d_head)
        tensors = {io_names.SRC_BIAS: self._bind_out(binding, io_names.SRC_BIAS, (b, s))}
        for i in range(self.cfg.n_dec_layers):
            tensors[io_names.cross_k(i)] = self._bind_out(binding, io_names.cross_k(i), cross)
            tensors[io_names.cross_v(i)] = self._bind_out(binding, io_names.cross_v(i), cross)
        self._run(self.encoder, binding, self._encoder_run_options)
        candidates = None
        if self.shortlist is not None:
            candidates = self._device_array(self.shortlist.candidates(host(src_ids)))
        return EncoderState(tensors, b, candidates=candidates)

    def initial_cache(self, n_rows: int) -> Any:
        if self.indirect:
            return IndirectCache(self.cfg, n_rows, max_steps=self.max_tgt_len)
        return super().initial_cache(n_rows)

    def step(self, state: EncoderState, tokens: Any, step: int, cache: Any,
             reorder: Any, want: Any = None) -> tuple[StepOutput, Any]:
        n = len(tokens)
        session, want_ids = self.decoder, None
        if want is not None:  # decoder_constrained.onnx (opened now if this is the first such step)
            session, want_ids = self.constrained.session(), want_array(host(want), n, self.cfg.vocab_size)
            if not want_ids.shape[1]:  # no ids asked for: the plain step
                session = self.decoder
        feeds = cache.advance(reorder, state.n_rows)  # IndirectCache: cache_indirection, bound below
        bound = state.bound
        if not isinstance(bound, StepBinding) or bound.n != n or bound.session is not session:
            bound = state.bound = self._step_binding(state, n, session)
        self._fill(bound.tokens, host(tokens, np.int64))
        if self.on_cuda:
            self._fill(bound.step, np.array([step], dtype=np.int64))
        else:
            bound.step[0] = step
        if want_ids is not None and session is not self.decoder:
            self._fill_want(bound, want_ids)
        if self.indirect:
            feeds = cache.bind(bound.binding)  # referenced until the run
        else:
            feeds = {name: self._bind_changed(bound, name, value) for name, value in feeds.items()}
        self._run(session, bound.binding)
        if self.indirect:
            cache.wrote()
        else:
            cache.append(bound.step_k, bound.step_v, bound.step_kv)
        want_lp = None if want_ids is None else (
            np.array(host(bound.want_lp)) if want_ids.shape[1] else np.empty((n, 0), np.float32))
        # copies: the bound outputs are overwritten by the next step
        return StepOutput(np.array(host(bound.top_lp)), np.array(host(bound.top_ids)),
                          np.array(host(bound.eos_lp)), want_lp), cache

    def _fill_want(self, bound: StepBinding, want: np.ndarray) -> None:
        """The constrained step's want_ids filled, its want_ids buffer and want_log_probs output bound again
        where the ids per hypothesis changed."""
        if bound.want is None or tuple(bound.want.shape) != want.shape:
            bound.want = self._bind_in(bound.binding, io_names.WANT_IDS, self._device_array(np.zeros_like(want)))
            bound.want_lp = self._bind_out(bound.binding, io_names.WANT_LOG_PROBS, want.shape)
        self._fill(bound.want, want)

    def _step_binding(self, state: EncoderState, n: int, session: ort.InferenceSession | None = None) -> StepBinding:
        """The binding of `session` (the decoder's by default, or the constrained one) for `n` hypotheses of
        `state`: its tensors (cross K/V, src_bias) and every output bound once; tokens and step in buffers bound
        once and filled per step."""
        session = self.decoder if session is None else session
        binding = session.io_binding()
        alive = {name: self._bind_in(binding, name, t) for name, t in state.tensors.items()}
        tokens, step = self._device_array(np.zeros(n, np.int64)), self._device_array(np.zeros(1, np.int64))
        alive[io_names.TOKENS] = self._bind_in(binding, io_names.TOKENS, tokens)
        alive[io_names.STEP] = self._bind_in(binding, io_names.STEP, step)
        if state.candidates is not None:
            alive[io_names.CANDIDATES] = self._bind_in(binding, io_names.CANDIDATES, state.candidates)
        d = self.cfg.d_model
        n_layers = 0 if self.indirect else self.cfg.n_dec_layers  # a cache per hypothesis: the graph writes it
        k = self._candidates(session, n, state.n_rows)
        names = [io_names.step_k(i) for i in range(n_layers)] + [io_names.step_v(i) for i in range(n_layers)]
        kv = None if self.on_cuda or not names else np.empty((len(names), n, d), self.out_types[names[0]])
        outs = [self._bind_out(binding, name, (n, d), None if kv is None else kv[i]) for i, name in enumerate(names)]
        return StepBinding(
            binding, session, n, tokens, step, alive,
            top_lp=self._bind_out(binding, io_names.TOPK_LOG_PROBS, (n, k)),
            top_ids=self._bind_out(binding, io_names.TOPK_IDS, (n, k)),
            eos_lp=self._bind_out(binding, io_names.EOS_LOG_PROBS, (n,)),
            step_k=outs[:n_layers], step_v=outs[n_layers:], step_kv=kv)

    def _candidates(self, session: ort.InferenceSession, n: int, sentences: int) -> int:
        """Candidates a row from `session`: min(topk, 2 x beam) where its K follows the beam (export/topk_split)."""
        if session not in self._follows_beam:
            meta = session.get_modelmeta().custom_metadata_map
            self._follows_beam[session] = meta.get(io_names.TOPK_FOLLOWS_BEAM) == "1"
        return min(self.topk, 2 * (n // sentences)) if self._follows_beam[session] else self.topk

    def _bind_changed(self, bound: StepBinding, name: str, a: Any) -> Any:
        """Bind a cache feed unless this very array is bound already (the buffers change only
        when the cache grows or drops sentences); returns what must stay referenced until the run."""
        ref = bound.feeds.get(name)
        if ref is not None and ref() is a:
            return a
        bound_a = self._bind_in(bound.binding, name, a)
        # a weak reference: the cache owns its buffers (a grown cache frees the old ones at once)
        bound.feeds[name] = weakref.ref(a) if bound_a is a else None
        return bound_a

    def _fill(self, buffer: Any, a: np.ndarray) -> None:
        if self.on_cuda:
            buffer.copy_(self._device_array(a))
        else:
            np.copyto(buffer, a)


def open_model_dir(model_dir: ModelDir, options: LoadOptions, shortlist: Shortlist | None) -> OrtBackend:
    """The registry's opener (runtime/registry.py): the dir's graphs in ONNX Runtime sessions; with
    parallel batches, each batch's runs get an equal share of the threads (of every usable core when
    --threads is not given). Without --parallel-batches, files of many batches (options.many_batches) on a CPU
    decode two at a time where there are two threads for them."""
    threads, batches = options.threads, options.parallel_batches
    if batches is None:
        on_cpu = default_device(options.device) == "cpu"
        batches = default_parallel_batches(threads) if options.many_batches and on_cpu else 1
    if batches > 1:
        if threads is None and batches > usable_cores():  # --threads given: refused when fewer (LoadOptions)
            log.warning("--parallel-batches %d on %d usable core(s): the batches take turns on the cores, each "
                        "holding its memory; pass --parallel-batches %d or fewer", batches, usable_cores(),
                        usable_cores())
        threads = max(1, (threads or usable_cores()) // batches)
        log.info("%d batches at once, each on %d thread(s)%s", batches, threads,
                 "" if options.parallel_batches else " (--parallel-batches 1: one at a time on every thread)")
    return OrtBackend(model_dir.path, model_dir.manifest, device=options.device, threads=threads,
                      shortlist=shortlist, parallel_batches=batches)
