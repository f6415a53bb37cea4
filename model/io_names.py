"""Names of the exported graphs' inputs, outputs and dynamic axes: defined once here,
used by export (to name them) and runtime (to feed them)."""

from __future__ import annotations

ENCODER_FILE = "encoder.onnx"
DECODER_FILE = "decoder.onnx"
# The decoder step over a vocabulary shortlist (export --shortlist-src/--shortlist-tgt): the same
# weights as decoder.onnx (read from decoder.data), projecting onto `candidates` only.
DECODER_SHORTLIST_FILE = "decoder_shortlist.onnx"
# The decoder step that also returns the log-probs of ids the caller asks for (constrained search:
# glossaries): decoder.onnx with one more input (want_ids) and output (want_log_probs), its weights
# read from decoder.data.
DECODER_CONSTRAINED_FILE = "decoder_constrained.onnx"
SHORTLIST_FILE = "shortlist.npz"  # the lexical table the candidates come from (runtime/shortlist.py)
ENCODER_ENGINE = "encoder.plan"
DECODER_ENGINE = "decoder.plan"


# A decoder graph's metadata key (ONNX metadata_props): "1" where its top-K takes min(topk, 2 x beam) candidates a
# row, the beam read off its inputs' shapes, instead of topk (export/topk_split.py; the ONNX Runtime backend binds
# outputs that wide)
TOPK_FOLLOWS_BEAM = "pipeline.topk_follows_beam"
# "decoder-masked" where each layer's self-attention is one com.microsoft.DecoderMaskedMultiHeadAttention over a
# cache per hypothesis (export/self_attention.py, runtime/indirect_cache.py): the inputs CACHE_INDIRECTION and
# self_k/self_v (hyps, n_heads, capacity, d_head), the outputs present_k/present_v (the same buffers), no step_k/v
SELF_ATTENTION = "pipeline.self_attention"
DECODER_MASKED = "decoder-masked"
# "multi-head" where each layer's cross-attention is one com.microsoft.MultiHeadAttention (export/cross_attention.py);
# the interface is unchanged
CROSS_ATTENTION = "pipeline.cross_attention"
MULTI_HEAD = "multi-head"


def weights_file(graph_file: str) -> str:
    """The file beside an exported graph that holds its weights (ONNX external data):
    encoder.onnx -> encoder.data."""
    return graph_file.rsplit(".", 1)[0] + ".data"


# Symbolic axes. Related inputs share one name, so shapes stay mutually consistent.
BATCH = "batch"          # sentences
SRC_LEN = "src_len"      # source tokens
HYPS = "hyps"            # hypotheses fed to the step: live sentences (batch) x rows each
PAST = "past"            # earlier steps each hypothesis attends to (1 at step 0: masked)
CACHE_ROWS = "cache_rows"  # self-attention keys held per sentence: capacity (steps) x rows
N_WANT = "n_want"        # ids per hypothesis whose log-probs a constrained step returns
N_CANDIDATES = "n_candidates"  # target ids a shortlisted step scores (the batch's candidate union)

# Encoder graph.
SRC_IDS = "src_ids"      # (batch, src_len) int64, padded with PAD_ID
SRC_BIAS = "src_bias"    # (batch, src_len) float32: 0 or MASK_VALUE (decoder: batch too)


def cross_k(layer: int) -> str:
    return f"cross_k.{layer}"   # (batch, n_heads, src_len, d_head): one row per sentence


def cross_v(layer: int) -> str:
    return f"cross_v.{layer}"


# Decoder-step graph.
TOKENS = "tokens"        # (hyps,) int64
STEP = "step"            # (1,) int64: the position being decoded
SELF_INDEX = "self_index"  # (hyps, n_heads, past) int64: rows of the flattened cache (model/cache.py)
SELF_BIAS = "self_bias"  # (hyps, past) float32: 0, or MASK_VALUE at step 0's placeholder
# decoder_shortlist.onnx only, its last input: (n_candidates,) int64 target ids, EOS first, then
# ascending; the step's log-softmax runs over them, and topk_ids are ids of the full vocabulary.
CANDIDATES = "candidates"
# decoder_constrained.onnx only: its last input, (hyps, n_want) int64 ids (-1: none), and its last output,
# (hyps, n_want) float32 their log-probs from the step's log-softmax (-inf for -1).
WANT_IDS = "want_ids"
WANT_LOG_PROBS = "want_log_probs"
# decoders with DecoderMaskedMultiHeadAttention (SELF_ATTENTION): (sentences, beam, capacity) int32, the beam row
# of its sentence that wrote each earlier position of a hypothesis' history (runtime/indirect_cache.py)
CACHE_INDIRECTION = "cache_indirection"


def present_k(layer: int) -> str:
    return f"present_k.{layer}"  # such a decoder's self_k.i with this step written, bound to the same memory


def present_v(layer: int) -> str:
    return f"present_v.{layer}"


def self_k(layer: int) -> str:
    return f"self_k.{layer}"    # (batch, n_heads, cache_rows, d_head): model/cache.py's layout


def self_v(layer: int) -> str:
    return f"self_v.{layer}"


def step_k(layer: int) -> str:
    return f"step_k.{layer}"  # (hyps, d_model): this step's keys, written into self_k by the caller


def step_v(layer: int) -> str:
    return f"step_v.{layer}"


TOPK_LOG_PROBS = "topk_log_probs"  # (hyps, K) float32, sorted descending
TOPK_IDS = "topk_ids"              # (hyps, K) int64
EOS_LOG_PROBS = "eos_log_probs"    # (hyps,) float32


def encoder_inputs() -> list[str]:
    return [SRC_IDS]


def encoder_outputs(n_layers: int) -> list[str]:
    names = [SRC_BIAS]
    for i in range(n_layers):
        names += [cross_k(i), cross_v(i)]
    return names


def decoder_inputs(n_layers: int) -> list[str]:
    names = [TOKENS, STEP, SELF_INDEX, SELF_BIAS]
    names += [self_k(i) for i in range(n_layers)] + [self_v(i) for i in range(n_layers)]
    names += [cross_k(i) for i in range(n_layers)] + [cross_v(i) for i in range(n_layers)]
    return names + [SRC_BIAS]


def decoder_shortlist_inputs(n_layers: int) -> list[str]:
    return decoder_inputs(n_layers) + [CANDIDATES]


def decoder_outputs(n_layers: int) -> list[str]:
    names = [TOPK_LOG_PROBS, TOPK_IDS, EOS_LOG_PROBS]
    names += [step_k(i) for i in range(n_layers)] + [step_v(i) for i in range(n_layers)]
    return names
