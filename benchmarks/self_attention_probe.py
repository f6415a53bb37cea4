"""What ONNX Runtime's DecoderMaskedMultiHeadAttention (a com.microsoft contrib op with a CPU kernel) would give
the CPU int8 decoder step in place of its self-attention subgraph (benchmarks/README.md, "self-attention-dmmha").
A probe, not the product: the model dir it writes is for this script only. The product has built it since
(export/self_attention.py, runtime/indirect_cache.py, whose cache and graph sort this probe now uses); the probe
still rewrites older model dirs for an A/B against their gathered decoder.

    python benchmarks/self_attention_probe.py make MODEL_DIR OUT_DIR
    python benchmarks/self_attention_probe.py ab MODEL_DIR OUT_DIR --src test2016.de --batch 32 --sentences 512 \\
        --rounds 3

`make` copies MODEL_DIR (a rowwise int8 export, top-K following the beam) and rewrites each decoder layer's
self-attention in decoder.onnx: the Gathers of the history by the ancestry index, the two one-row matmuls, the
Softmax, the Slices and the Concat of the step's own key become one node,

    DecoderMaskedMultiHeadAttention(q, k, v, past_key=self_k.i, past_value=self_v.i,
                                    past_sequence_length=step, beam_width=hyps / sentences, cache_indirection)

with the cache laid out per hypothesis, (hyps, heads, capacity, d_head), written by the node in place
(past_present_share_buffer: present_k.i is bound to self_k.i's memory), and `cache_indirection` (sentences,
beam, capacity) int32: which of its sentence's beam rows wrote each earlier position of a hypothesis' history, the
ancestry model/cache.py keeps as `slots`. The graph's step_k/step_v outputs, self_index and self_bias go.

`ab` decodes the file's first N lines, sorted by length as serve-batch batches them, with beam 4 on one thread,
alternating fresh processes: runtime's onnxruntime backend on MODEL_DIR, and a subclass of it (below) stepping
OUT_DIR's decoder with the indirect cache. It prints ms a sentence and how many best hypotheses are identical."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make(src: Path, dst: Path, cross: bool = False) -> None:
    import onnx
    from onnx import TensorProto, helper

    from model.manifest import read_manifest

    cfg = read_manifest(src, verify=False).model_config
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    proto = onnx.load(src / "decoder.onnx", load_external_data=False)
    g = proto.graph
    produced = {o: n for n in g.node for o in n.output}
    n_layers, h, dh = cfg.n_dec_layers, cfg.n_heads, cfg.d_head
    nodes = [
        helper.make_node("Cast", ["step"], ["dm/past"], to=TensorProto.INT32, name="dm/past"),
        helper.make_node("Shape", ["tokens"], ["dm/hyps"], name="dm/hyps"),
        helper.make_node("Shape", ["src_bias"], ["dm/src_shape"], start=0, end=1, name="dm/sentences"),
        helper.make_node("Div", ["dm/hyps", "dm/src_shape"], ["dm/beam64"], name="dm/beam64"),
        helper.make_node("Cast", ["dm/beam64"], ["dm/beam"], to=TensorProto.INT32, name="dm/beam"),
    ]
    for i in range(n_layers):
        split = produced[next(n for n in g.node if n.output[0] == f"step_k.{i}").input[0]]  # the fused q/k/v
        out_proj = next(n for n in g.node if n.op_type == "MatMulIntegerToFloat"
                        and f"model.decoder.{i}.self_attn.out_proj.bias" in n.input)
        attention = produced[out_proj.input[0]].input[0]  # what the out-projection's quantization reads
        q, k, v = split.output
        nodes.append(helper.make_node(
            "DecoderMaskedMultiHeadAttention",
            [q, k, v, "", "", f"self_k.{i}", f"self_v.{i}", "dm/past", "dm/beam", "cache_indirection"],
            [f"dm/out{i}", f"present_k.{i}", f"present_v.{i}"], domain="com.microsoft", name=f"dm/attention{i}",
            num_heads=h, past_present_share_buffer=1, scale=float(dh ** -0.5)))
        for n in g.node:
            n.input[:] = [f"dm/out{i}" if x == attention else x for x in n.input]
        if cross:
            nodes += _cross_attention(g, produced, i, h)
    for n in g.node:  # older exports read the sentences off self_k / self_v (their axis 0): now cross_k.0's
        if n.op_type == "Shape" and n.input[0].startswith("self_"):
            n.input[0] = "cross_k.0"
    cache = ["hyps", h, "capacity", dh]
    outputs = [o for o in g.output if not o.name.startswith(("step_k.", "step_v."))]
    outputs += [helper.make_tensor_value_info(f"present_{kv}.{i}", TensorProto.FLOAT, cache)
                for i in range(n_layers) for kv in "kv"]
    inputs = [x for x in g.input if not x.name.startswith("self_")]  # self_index, self_bias, self_k.i, self_v.i
    inputs += [helper.make_tensor_value_info(f"self_{kv}.{i}", TensorProto.FLOAT, cache)
               for i in range(n_layers) for kv in "kv"]
    inputs.append(helper.make_tensor_value_info("cache_indirection", TensorProto.INT32,
                                                ["sentences", "beam", "capacity"]))
    del g.output[:], g.input[:]
    g.output.extend(outputs)
    g.input.extend(inputs)
    from export.self_attention import _prune_and_sort

    _prune_and_sort(g, list(g.node) + nodes)
    onnx.save(proto, dst / "decoder.onnx")
    print(f"{dst}/decoder.onnx: {len(g.node)} nodes, self-attention in {n_layers} DecoderMaskedMultiHeadAttention")


def _cross_attention(g: Any, produced: dict[str, Any], i: int, h: int) -> list[Any]:
    """--cross: layer i's cross-attention (the beam's queries of a sentence against its one row of cross K/V:
    Reshape, Transposes, the scaled matmul, the source bias, Softmax, matmul, Transpose, Reshape) as one
    com.microsoft.MultiHeadAttention over (sentences, beam, d_model) queries and the cross_k.i / cross_v.i
    (sentences, heads, source, d_head) as they are, the source bias broadcast over the beam."""
    import onnx
    from onnx import helper

    q_proj = next(n for n in g.node if n.op_type == "MatMulIntegerToFloat"
                  and f"model.decoder.{i}.cross_attn.q_proj.bias" in n.input)
    out_proj = next(n for n in g.node if n.op_type == "MatMulIntegerToFloat"
                    and f"model.decoder.{i}.cross_attn.out_proj.bias" in n.input)
    attention = produced[out_proj.input[0]].input[0]
    for n in g.node:
        n.input[:] = [f"mha/out{i}" if x == attention else x for x in n.input]
    nodes = []
    if i == 0:  # the source bias (sentences, 1, beam, source), once for every layer
        g.initializer.append(onnx.numpy_helper.from_array(np.array([1, 1], np.int64), "mha/ones2"))
        g.initializer.append(onnx.numpy_helper.from_array(np.array([1], np.int64), "mha/one"))
        g.initializer.append(onnx.numpy_helper.from_array(np.array([1, 2], np.int64), "mha/axes12"))
        nodes += [
            helper.make_node("Reshape", ["dm/beam64", "mha/one"], ["mha/beam1"], name="mha/beam1"),
            helper.make_node("Concat", ["mha/ones2", "mha/beam1", "mha/one"], ["mha/expand"], axis=0, name="mha/ex"),
            helper.make_node("Unsqueeze", ["src_bias", "mha/axes12"], ["mha/bias4"], name="mha/bias4"),
            helper.make_node("Expand", ["mha/bias4", "mha/expand"], ["mha/bias"], name="mha/bias"),
        ]
    nodes.append(helper.make_node(
        "MultiHeadAttention", [q_proj.output[0], f"cross_k.{i}", f"cross_v.{i}", "", "", "mha/bias"],
        [f"mha/out{i}"], domain="com.microsoft", name=f"mha/attention{i}", num_heads=h))
    return nodes


def _indirect_backend(opened: Any, probe_dir: Path) -> Any:
    import onnxruntime as ort

    from runtime.backend import StepOutput, host
    from runtime.ort_backend import OrtBackend, session_config

    class IndirectBackend(OrtBackend):
        def initial_cache(self, n_rows: int) -> Any:
            from runtime.indirect_cache import IndirectCache  # the product's cache since it was built

            return IndirectCache(self.cfg, n_rows, max_steps=self.max_tgt_len)

        def step(self, state: Any, tokens: Any, step: int, cache: Any, reorder: Any, want: Any = None) -> Any:
            n = len(tokens)
            ancestry = cache.advance(reorder, state.n_rows)
            bound = state.bound
            if bound is None or bound["n"] != n:
                binding = self.decoder.io_binding()
                k = self._candidates(self.decoder, n, state.n_rows)
                bound = state.bound = {
                    "n": n, "binding": binding, "generation": -1,
                    "alive": {name: self._bind_in(binding, name, t) for name, t in state.tensors.items()},
                    "tokens": self._bind_in(binding, "tokens", np.zeros(n, np.int64)),
                    "step": self._bind_in(binding, "step", np.zeros(1, np.int64)),
                    "top_lp": self._bind_out(binding, "topk_log_probs", (n, k)),
                    "top_ids": self._bind_out(binding, "topk_ids", (n, k)),
                    "eos_lp": self._bind_out(binding, "eos_log_probs", (n,))}
            binding = bound["binding"]
            np.copyto(bound["tokens"], host(tokens, np.int64))
            bound["step"][0] = step
            if bound["generation"] != cache.generation:
                layers = self.cfg.n_dec_layers
                for i in range(layers):
                    for j, kv in enumerate("kv"):
                        a = cache.kv[j * layers + i]
                        binding.bind_cpu_input(f"self_{kv}.{i}", a)
                        binding.bind_output(f"present_{kv}.{i}", "cpu", 0, np.float32, list(a.shape), a.ctypes.data)
                bound["generation"] = cache.generation
            binding.bind_cpu_input("cache_indirection", ancestry)
            self._run(self.decoder, binding)
            cache.steps += 1
            return StepOutput(bound["top_lp"].copy(), bound["top_ids"].copy(), bound["eos_lp"].copy()), cache

    backend = IndirectBackend(opened.path, opened.manifest, threads=1)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = 1, 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    for key, value in session_config(opened.manifest).items():
        opts.add_session_config_entry(key, value)
    backend.decoder = ort.InferenceSession(str(probe_dir / "decoder.onnx"), opts, providers=["CPUExecutionProvider"])
    return backend


def once(kind: str, model_dir: Path, probe_dir: Path, src: Path, batch: int, n: int, out: Path) -> None:
    from runtime.model_dir import ModelDir
    from runtime.ort_backend import OrtBackend
    from runtime.search import beam_search
    from runtime.translate import pad_batch

    opened = ModelDir.open(model_dir)
    if kind == "indirect":
        backend = _indirect_backend(opened, probe_dir)
    else:
        backend = OrtBackend(opened.path, opened.manifest, threads=1)
    lines = [line.strip() for line in src.read_text(encoding="utf-8").splitlines() if line.strip()][:n]
    ids = sorted(opened.tokenizer.encode_source(lines), key=len)  # the model dir's own tokenizer (Marian's too)
    batches = [pad_batch(ids[i:i + batch], backend.cfg.pad_id) for i in range(0, len(ids), batch)]
    for x in batches[:max(1, len(batches) // 4)]:  # warm-up
        beam_search(backend, x, beam_size=4)
    start = time.perf_counter()
    best = [hyps[0].tokens for x in batches for hyps in beam_search(backend, x, beam_size=4)]
    out.write_text(json.dumps({"ms": (time.perf_counter() - start) / len(lines) * 1e3, "best": best}))


def ab(model_dir: Path, probe_dir: Path, src: Path, batch: int, n: int, rounds: int) -> None:
    kinds = ("graph as exported", "indirect")
    ms: dict[str, list[float]] = {k: [] for k in kinds}
    best: dict[str, list[list[int]]] = {}
    out = probe_dir / "probe-out.json"
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            subprocess.run([sys.executable, __file__, "once", kind, str(model_dir), str(probe_dir), "--src", str(src),
                            "--batch", str(batch), "--sentences", str(n), "--out", str(out)], check=True)
            got = json.loads(out.read_text())
            ms[kind].append(got["ms"])
            best[kind] = got["best"]
    same = sum(a == b for a, b in zip(*best.values()))
    base = statistics.median(ms[kinds[0]])
    for kind in kinds:
        print(f"{kind:18s} {statistics.median(ms[kind]):7.3f} ms a sentence (median of {rounds}; "
              f"{[round(x, 3) for x in ms[kind]]}), {statistics.median(ms[kind]) / base:.3f}x the first's time")
    print(f"best hypotheses identical: {same} of {len(best[kinds[0]])}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("model_dir", type=Path)
    m.add_argument("out_dir", type=Path)
    m.add_argument("--cross", action="store_true", help="the cross-attention too, as MultiHeadAttention")
    for name in ("ab", "once"):
        o = sub.add_parser(name)
        if name == "once":
            o.add_argument("kind")
        o.add_argument("model_dir", type=Path)
        o.add_argument("probe_dir", type=Path)
        o.add_argument("--src", type=Path, required=True)
        o.add_argument("--batch", type=int, default=32)
        o.add_argument("--sentences", type=int, default=512)
        o.add_argument("--rounds", type=int, default=3)
        o.add_argument("--out", type=Path)
    a = p.parse_args()
    if a.cmd == "make":
        make(a.model_dir, a.out_dir, a.cross)
    elif a.cmd == "once":
        once(a.kind, a.model_dir, a.probe_dir, a.src, a.batch, a.sentences, a.out)
    else:
        ab(a.model_dir, a.probe_dir, a.src, a.batch, a.sentences, a.rounds)


if __name__ == "__main__":
    main()
