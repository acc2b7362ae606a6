"""Lean Llama-family decoder (Llama, SmolLM, Mistral, Qwen2) with a static, batched KV cache.

Every forward is *packed*: a flat list of N tokens, each with the cache slot (request) it belongs
to and its absolute position, so no request is padded to another's length. The weight matmuls run
once over all N rows; attention reads each row's own slot of the cache. Both go through kernels
whose per-row numerics do not depend on N (plugins/), so a k-token verification forward gives
exactly the logits of k one-token forwards. The cache is written at the explicit positions; a request's cache length is
tracked by the runtime, and stale entries past it (rejected drafts) are masked by position and
overwritten by the next step, which is how rollback costs nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from angelspec import DEFAULT_MAX_LEN
from angelspec.plugins import (
    SKINNY_MAX_ROWS,
    cached_attention,
    linear,
    rms_norm,
    rope_,
    silu_mul,
)
from angelspec.plugins.attention import KEY_TILE, keys, kv_cache
from angelspec.plugins.decoder_layer import decoder_stack, prepare_stack

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    architecture: str = "LlamaForCausalLM"
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Read a Hugging Face config.json dict; unsupported models raise ValueError."""
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}: AngelSpec targets must be one of "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only SwiGLU/silu Llama-family MLPs)")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        qwen = arch == "Qwen2ForCausalLM"
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", not qwen) else None
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=qwen or cfg.get("attention_bias", False),
            o_bias=(not qwen) and cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False), sliding_window=window, architecture=arch,
            eos_token_ids=eos)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] with the checkpoint's theta and rope_scaling."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / sc["factor"]).float()
    if kind == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(is_mid, mid, scaled).float()
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


KV_CACHES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # the cache's value types


class KVCache:
    """Static cache, per layer: k and v as plugins.attention.kv_cache lays them out (keys in
    transposed tiles of 16, values [slots, kv_heads, positions, head_dim]), float32 or bf16 (each
    key and value rounded once as it is written; attention widens them back and computes in
    float32: a row reads its own key from the cache too, so verification stays row-exact)."""

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, dtype=torch.float32):
        pairs = [kv_cache(slots, cfg.num_kv_heads, cfg.head_dim, max_len, dtype)
                 for _ in range(cfg.num_layers)]
        self.k, self.v = [k for k, _ in pairs], [v for _, v in pairs]
        self.slots, self.max_len = slots, max_len

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Copy the entries of positions src to positions dst in every layer (a token tree's
        accepted path, to where the chain of its tokens belongs)."""
        src, dst = torch.tensor(src), torch.tensor(dst)
        st, sl, dt, dl = src // KEY_TILE, src % KEY_TILE, dst // KEY_TILE, dst % KEY_TILE
        for k, v in zip(self.k, self.v):
            k[slot, :, dt, :, dl] = k[slot, :, st, :, sl]
            v[slot, :, dst] = v[slot, :, src]

    def keys(self, layer: int) -> torch.Tensor:
        """Layer's keys as [slots, kv_heads, head_dim, positions] (a copy)."""
        return keys(self.k[layer])

    def save(self, slot: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The entries of slot's first n positions, every layer (copies, for `restore`)."""
        tiles = -(-n // KEY_TILE)
        return [(k[slot, :, :tiles].clone(), v[slot, :, :n].clone()) for k, v in zip(self.k, self.v)]

    def restore(self, slot: int, saved: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        """Write `save`'s entries of n positions back as slot's first n positions."""
        full, part = divmod(n, KEY_TILE)
        for k, v, (sk, sv) in zip(self.k, self.v, saved):
            k[slot, :, :full] = sk[:, :full]
            if part:
                k[slot, :, full, :, :part] = sk[:, full, :, :part]
            v[slot, :, :n] = sv


@dataclass
class Segment:
    """One request's run of tokens inside a packed forward: cache slot, first position, length.

    `parents` makes the run a token tree: parents[i] < i is the index of token i's parent in the
    run, -1 for the root (the first token). Token i is then at position start + its depth (RoPE)
    and sees the cache before `start` and its own ancestors only; its key and value are stored at
    start + i, whence runtime/step.py moves the accepted path's entries into place."""
    slot: int
    start: int
    length: int
    parents: torch.Tensor | None = None

    def depths(self) -> torch.Tensor:
        """Depth of every token (0 for the root; a chain: 0..length-1)."""
        if self.parents is None:
            return torch.arange(self.length)
        depth = torch.zeros(self.length, dtype=torch.long)
        for i, p in enumerate(self.parents.tolist()):
            depth[i] = 0 if p < 0 else depth[p] + 1
        return depth


class Batch:
    """Per-token slot, cache position and RoPE position of a packed forward (and, for token
    trees, each token's parent row), built once and shared by all layers."""

    def __init__(self, segments: list[Segment]):
        # one tensor from a list each (a decoding step's batch is a few rows: each torch call is
        # tens of microseconds once a forward has streamed the weights through the caches)
        self.positions = torch.tensor([p for s in segments for p in range(s.start, s.start + s.length)])
        self.slots = torch.tensor([s.slot for s in segments for _ in range(s.length)])
        self.kv_len = max(s.start + s.length for s in segments)
        self.parents = None
        self.rope_positions = self.positions
        if any(s.parents is not None for s in segments):
            rows = torch.tensor([0] + [s.length for s in segments]).cumsum(0)
            self.parents = torch.cat([
                torch.arange(s.length) - 1 + r if s.parents is None else
                torch.where(s.parents >= 0, s.parents + r, -1)
                for s, r in zip(segments, rows.tolist())])
            self.parents[rows[:-1]] = -1
            self.rope_positions = torch.cat([s.start + s.depths() for s in segments])


class Llama:
    """Weights as plain tensors (fused qkv and gate_up), functions over packed tokens."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], max_len: int = DEFAULT_MAX_LEN):
        self.cfg = cfg
        w = weights
        # taken out of `weights` as they are converted: a bf16 checkpoint's tensors are freed
        # layer by layer, never all held beside their float32 copies
        get = lambda k: w.pop(k).float().contiguous()  # noqa: E731
        opt = lambda k: w.pop(k).float().contiguous() if k in w else None  # noqa: E731
        self.embed = get("model.embed_tokens.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings or "lm_head.weight" not in w \
            else get("lm_head.weight")
        self.head_w = self.lm_head  # what head() multiplies by (angelspec.weights: the served form)
        self.weights = "float32"  # how the matmul weights are served (angelspec.weights)
        self.backend = "eager"  # how forward runs (runtime/backend.py: use_backend)
        self.compiled = None  # the compiled forward of a compiled backend
        self.fused = True  # decoding forwards run every layer in one call (plugins.decoder_layer)
        self.kv_dtype = torch.float32  # the KV cache's values (KV_CACHES; new_cache)
        self._prepared = None  # the layers as decoder_stack takes them (prepare_stack), built at first use
        self.norm = get("model.norm.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv_b = None
            if cfg.qkv_bias:
                qkv_b = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            gate_up_b = None
            if cfg.mlp_bias:
                gate_up_b = torch.cat([get(p + "mlp.gate_proj.bias"), get(p + "mlp.up_proj.bias")])
            self.layers.append(dict(
                in_norm=get(p + "input_layernorm.weight"),
                qkv=torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                qkv_b=qkv_b,
                o=get(p + "self_attn.o_proj.weight"), o_b=opt(p + "self_attn.o_proj.bias"),
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
                gate_up_b=gate_up_b,
                down=get(p + "mlp.down_proj.weight"), down_b=opt(p + "mlp.down_proj.bias"),
            ))
        inv = rope_inv_freq(cfg)
        ang = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
        ang = torch.cat([ang, ang], dim=-1)
        self.cos, self.sin = ang.cos().contiguous(), ang.sin().contiguous()
        self.max_len = max_len

    def invalidate(self) -> None:
        """The layers' tensors changed (angelspec.weights): what was prepared from them goes."""
        self._prepared = None

    def new_cache(self, slots: int, max_len: int | None = None) -> KVCache:
        return KVCache(self.cfg, slots, max_len or self.max_len, self.kv_dtype)

    def batch(self, segments: list[Segment]) -> Batch:
        return Batch(segments)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, batch: Batch, cache: KVCache,
                logit_rows: torch.Tensor | None = None, capture: tuple[int, ...] = ()):
        """tokens [N] packed as `batch` says -> (logits [R, vocab], {layer: hidden [N, h]}).

        R = N, or len(logit_rows) when given (prefill needs only the last row). `capture` lists
        hidden-state indices in Hugging Face's convention: 0 = embeddings, i = output of decoder
        layer i (so num_layers = the last hidden state before the final norm). With a compiled
        backend (runtime/backend.py) decoding and verification forwards, up to SKINNY_MAX_ROWS
        tokens (the row-exact kernels), run its graph; prompt prefill stays eager.
        """
        if self.compiled is not None and len(tokens) <= SKINNY_MAX_ROWS:
            return self.compiled(tokens, batch, cache, logit_rows, capture)
        return self.eager_forward(tokens, batch, cache, logit_rows, capture)

    def eager_forward(self, tokens: torch.Tensor, batch: Batch, cache: KVCache,
                      logit_rows: torch.Tensor | None = None, capture: tuple[int, ...] = ()):
        cfg = self.cfg
        if batch.kv_len > cache.max_len:
            raise ValueError(f"sequence of {batch.kv_len} tokens exceeds the cache ({cache.max_len})")
        nq, nkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        # decoding and verification: every layer in one op, the same kernels in the same order,
        # the embedding lookup before them and the head after them in the same call
        if self.fused and len(tokens) <= SKINNY_MAX_ROWS and not torch.compiler.is_compiling():
            if self._prepared is None:
                self._prepared = prepare_stack(self.layers, eps, nq, nkv, hd, self.embed, (self.norm, self.head_w))
            hidden = {0: F.embedding(tokens, self.embed)} if 0 in capture else {}
            layers = [i for i in capture if i > 0]
            head = logit_rows is None  # prefill's few rows: the head after
            x, outs = decoder_stack(hidden.get(0, tokens), self._prepared, self.cos, self.sin, batch.rope_positions,
                                    cache.k, cache.v, batch.slots, batch.positions, batch.parents,
                                    cfg.sliding_window, layers, head)
            hidden.update(zip(layers, outs))
            if head:
                return x, hidden
        else:
            x = F.embedding(tokens, self.embed)
            hidden = {0: x} if 0 in capture else {}
            for i, layer in enumerate(self.layers):
                qkv = linear(rms_norm(x, layer["in_norm"], eps), layer["qkv"], layer["qkv_b"])
                qkv = qkv.view(-1, nq + 2 * nkv, hd)
                rope_(qkv, self.cos, self.sin, batch.rope_positions, nq + nkv)
                q, k, v = qkv.split([nq, nkv, nkv], dim=1)
                attn = self._attention(q, k, v, batch, cache.k[i], cache.v[i])
                x = x + linear(attn, layer["o"], layer["o_b"])
                gate_up = linear(rms_norm(x, layer["post_norm"], eps), layer["gate_up"],
                                 layer["gate_up_b"])
                x = x + linear(silu_mul(gate_up), layer["down"], layer["down_b"])
                if i + 1 in capture:
                    hidden[i + 1] = x
        if logit_rows is not None:
            if not len(logit_rows):  # no row's logits: no head
                return x.new_empty(0, self.cfg.vocab_size), hidden
            x = x[logit_rows]
        return self.head(x), hidden

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Last hidden states [n, h] -> logits: the final norm and the lm_head."""
        return linear(rms_norm(x, self.norm, self.cfg.rms_norm_eps), self.head_w)

    def _attention(self, q, k, v, batch: Batch, ck: torch.Tensor, cv: torch.Tensor):
        """q [N, H, hd], k/v [N, Hkv, hd] -> [N, H*hd]; writes k/v into the cache first."""
        out = cached_attention(q, k, v, ck, cv, batch.slots, batch.positions,
                               self.cfg.sliding_window, batch.parents)
        return out.view(len(q), -1)
