"""Model configuration: one frozen dataclass, saved inside every checkpoint."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from model.errors import UserError

# SentencePiece ids fixed for every model of this project (see runtime/tokenizer and
# pipeline/corpus/data, which train the SentencePiece model with exactly these ids).
PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3

# Additive attention bias for masked positions. Finite, and far inside fp16 range
# (65504), so masks never produce inf or NaN; exp(-1e4) is exactly 0 in fp32.
MASK_VALUE = -1e4

ACTIVATIONS = ("relu", "swish", "gelu")  # swish = SiLU, x * sigmoid(x); gelu: the exact (erf) one
# sinusoid layouts: the paper's sin/cos interleaved; Marian's (sines, then cosines); fairseq's (tensor2tensor's
# frequencies 10000^(-i/(d/2-1)), sines then cosines: M2M-100 and NLLB)
POSITION_LAYOUTS = ("interleaved", "halves", "fairseq")


# Above any model this project serves (M2M-100's largest is 12B): a size typed with too many digits, refused
# before torch tries to allocate it.
MAX_PARAMETERS = 50_000_000_000
MAX_VOCAB = 1 << 20  # SentencePiece vocabularies to train (NLLB's is 256k): past it, sizes typed by mistake
MIN_VOCAB = 8  # the smallest SentencePiece vocabulary training asks for (its 4 special pieces and a few)


class ConfigError(UserError, ValueError):
    """A configuration that cannot describe a Transformer."""


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of the Transformer of "Attention Is All You Need" (section 3)."""

    vocab_size: int
    d_model: int = 512
    n_heads: int = 8
    d_ff: int = 2048
    n_enc_layers: int = 6
    n_dec_layers: int = 6
    dropout: float = 0.1
    max_positions: int = 1024
    pad_id: int = PAD_ID
    bos_id: int = BOS_ID  # the decoder's start token
    eos_id: int = EOS_ID
    unk_id: int = UNK_ID
    # What models trained elsewhere differ in (pipeline/importers); the defaults are the paper's.
    activation: str = "relu"  # the feed-forward's: "relu" (the paper), "swish" (OPUS-MT), "gelu"
    positions: str = "interleaved"  # sinusoid layout: sin/cos interleaved (the paper) or "halves" (Marian)
    scale_embedding: bool = True  # embeddings times sqrt(d_model) (section 3.4)
    logits_bias: bool = False  # a bias vector added to the output logits (Marian's final_logits_bias)
    suppress_ids: tuple[int, ...] = ()  # ids never generated: log-prob -inf (Marian's bad_words_ids [[pad]])
    position_offset: int = 0  # position t reads the sinusoid table's row t + offset (M2M-100: padding id + 1)
    pre_norm: bool = False  # LayerNorm before each sublayer, and one after each stack (M2M-100, NLLB)
    enc_heads: int | None = None  # the encoder's self-attention heads where they differ from n_heads
    enc_d_ff: int | None = None  # the encoder's feed-forward width where it differs from d_ff
    # A multilingual model's language-code tokens, (code, token id) pairs: a source starts with its language's
    # token, and the target language's token is forced as the first generated one (M2M-100, NLLB).
    languages: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "suppress_ids", tuple(self.suppress_ids))  # a JSON list read back
        if isinstance(self.languages, (list, tuple)):  # JSON gives lists of lists
            object.__setattr__(self, "languages", tuple(tuple(pair) for pair in self.languages))
        self.validate()

    @property
    def d_head(self) -> int:
        """The decoder's (and the caches'): self- and cross-attention use n_heads."""
        return self.d_model // self.n_heads

    @property
    def encoder_heads(self) -> int:
        return self.n_heads if self.enc_heads is None else self.enc_heads

    @property
    def encoder_d_ff(self) -> int:
        return self.d_ff if self.enc_d_ff is None else self.enc_d_ff

    @property
    def language_ids(self) -> dict[str, int]:
        """Language code -> its token id ({} for a model of one language pair)."""
        return dict(self.languages)

    def validate(self) -> None:
        """Collect every problem, then fail once with all of them."""
        problems = []
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "n_enc_layers",
                     "n_dec_layers", "max_positions"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                problems.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("enc_heads", "enc_d_ff"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                problems.append(f"{name} must be a positive integer or null, got {value!r}")
        if not problems:
            for name, heads in (("n_heads", self.n_heads), ("enc_heads", self.enc_heads)):
                if heads is not None and self.d_model % heads:  # (enc_heads None: n_heads, said once)
                    problems.append(f"d_model ({self.d_model}) must be divisible by {name} ({heads})")
        if not problems and self.d_model % 2:
            problems.append(f"d_model ({self.d_model}) must be even for sinusoidal positions")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        for name in ("pad_id", "bos_id", "eos_id", "unk_id"):
            value = getattr(self, name)
            if isinstance(self.vocab_size, int) and not 0 <= value < self.vocab_size:
                problems.append(f"{name} ({value}) must be a valid id below vocab_size ({self.vocab_size})")
        if self.eos_id in self.suppress_ids:
            problems.append(f"suppress_ids must not hold eos_id ({self.eos_id}): nothing could end")
        if isinstance(self.vocab_size, int) and any(not 0 <= i < self.vocab_size for i in self.suppress_ids):
            problems.append(f"suppress_ids {list(self.suppress_ids)} must be ids below vocab_size ({self.vocab_size})")
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation {self.activation!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.positions not in POSITION_LAYOUTS:
            problems.append(f"positions {self.positions!r} is not one of {', '.join(POSITION_LAYOUTS)}")
        if not isinstance(self.position_offset, int) or isinstance(self.position_offset, bool) \
                or self.position_offset < 0:
            problems.append(f"position_offset must be an integer of 0 or more, got {self.position_offset!r}")
        problems += self._language_problems()
        if not problems and self.approx_parameters() > MAX_PARAMETERS:  # before anything is allocated
            sizes = ", ".join(f"{k} {getattr(self, k)}" for k in ("vocab_size", "d_model", "d_ff", "n_enc_layers",
                                                                   "n_dec_layers"))
            problems.append(f"about {self.approx_parameters():.3g} parameters ({sizes}), more than MAX_PARAMETERS "
                            f"({MAX_PARAMETERS:.0e}, {4 * MAX_PARAMETERS / 1e9:.0f} GB in fp32); check the sizes")
        if problems:
            raise ConfigError("invalid model config: " + "; ".join(problems))

    def approx_parameters(self) -> int:
        """The weights' count, to refuse absurd sizes before allocating: the tied embedding, each encoder layer's
        attention (4 d^2) and feed-forward (2 d d_ff), each decoder layer's two attentions and feed-forward."""
        d = self.d_model
        return (self.vocab_size * d + self.n_enc_layers * (4 * d * d + 2 * d * self.encoder_d_ff)
                + self.n_dec_layers * (8 * d * d + 2 * d * self.d_ff))

    def _language_problems(self) -> list[str]:
        if not isinstance(self.languages, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and p[0]
                and isinstance(p[1], int) and not isinstance(p[1], bool) for p in self.languages):
            return [f"languages must be (code, token id) pairs, got {self.languages!r:.80}"]
        codes = [code for code, _ in self.languages]
        if len(set(codes)) != len(codes):
            return ["languages name a code twice"]
        ids = [i for _, i in self.languages]
        if isinstance(self.vocab_size, int) and any(not 0 <= i < self.vocab_size for i in ids):
            return [f"languages' token ids must be below vocab_size ({self.vocab_size})"]
        return []

    def to_dict(self) -> dict[str, Any]:
        """Every field, except the later ones (OPTIONAL_FIELDS) at their defaults: a model that does not use
        them is written byte for byte as before they existed, and older readers still take it."""
        data = dataclasses.asdict(self)
        return {k: v for k, v in data.items() if not (k in OPTIONAL_FIELDS and v == OPTIONAL_FIELDS[k])}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown model config keys: {', '.join(unknown)}")
        return cls(**data)


# Fields added after checkpoints and model dirs were first written, with the value meaning "not used"
# (ModelConfig.to_dict leaves them out then)
OPTIONAL_FIELDS: dict[str, Any] = {"position_offset": 0, "pre_norm": False, "enc_heads": None, "enc_d_ff": None,
                                   "languages": ()}


@dataclass(frozen=True)
class Preset:
    """One named model size: its shape and the training defaults it was tuned with, in one
    row so that a new preset cannot lack either (every field is required)."""

    d_model: int
    n_heads: int
    d_ff: int
    layers: int  # encoder layers (and decoder layers, unless decoder_layers says otherwise)
    dropout: float
    vocab_size: int  # joint SentencePiece vocabulary
    batch_tokens: int  # per process and micro-batch
    warmup: int
    max_steps: int
    label_smoothing: float
    decoder_layers: int | None = None  # a deep-encoder, shallow-decoder preset's decoder depth

    def shape(self) -> dict[str, Any]:
        """The ModelConfig fields of this preset (vocab_size comes from the tokenizer)."""
        return dict(d_model=self.d_model, n_heads=self.n_heads, d_ff=self.d_ff, n_enc_layers=self.layers,
                    n_dec_layers=self.layers if self.decoder_layers is None else self.decoder_layers,
                    dropout=self.dropout)

    def training_defaults(self) -> dict[str, Any]:
        """What `pipeline train` uses for the options left unset."""
        return dict(batch_tokens=self.batch_tokens, warmup=self.warmup, max_steps=self.max_steps,
                    vocab_size=self.vocab_size, dropout=self.dropout, label_smoothing=self.label_smoothing)


# `base` and `big` are the paper's (Table 3: 25k-token batches, 4000 warmup steps, 100k /
# 300k steps). The others are for CPUs: small models learn faster and are unstable at the
# paper's long warmup with tiny batches, so they get short warmups and small budgets.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(d_model=32, n_heads=4, d_ff=64, layers=2, dropout=0.0,
                   vocab_size=1000, batch_tokens=1024, warmup=200, max_steps=2000,
                   label_smoothing=0.1),
    "demo": Preset(d_model=64, n_heads=4, d_ff=256, layers=2, dropout=0.1,
                   vocab_size=4000, batch_tokens=4096, warmup=800, max_steps=20000,
                   label_smoothing=0.1),
    "small": Preset(d_model=256, n_heads=4, d_ff=1024, layers=3, dropout=0.1,
                    vocab_size=8000, batch_tokens=8192, warmup=2000, max_steps=50000,
                    label_smoothing=0.1),
    # small with one decoder layer, since batch-1 latency follows the decoder's depth and, trained from
    # scratch, a 6-layer encoder learns far more slowly than small's 3 (docs/training.md, "Levers")
    "small-fast": Preset(d_model=256, n_heads=4, d_ff=1024, layers=3, decoder_layers=1, dropout=0.1,
                         vocab_size=8000, batch_tokens=8192, warmup=2000, max_steps=50000,
                         label_smoothing=0.1),
    "base": Preset(d_model=512, n_heads=8, d_ff=2048, layers=6, dropout=0.1,
                   vocab_size=32000, batch_tokens=25000, warmup=4000, max_steps=100000,
                   label_smoothing=0.1),
    "big": Preset(d_model=1024, n_heads=16, d_ff=4096, layers=6, dropout=0.3,
                  vocab_size=32000, batch_tokens=25000, warmup=4000, max_steps=300000,
                  label_smoothing=0.1),
}


def preset(name: str, vocab_size: int, **overrides: Any) -> ModelConfig:
    """Build a config from a named preset, with optional overrides (None values ignored)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    values = dict(PRESETS[name].shape(), vocab_size=vocab_size)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ModelConfig(**values)
