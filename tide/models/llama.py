"""Llama-family target model in plain PyTorch (Llama, SmolLM, Qwen2 qkv bias, Qwen3 q/k norms).

The model reads and writes a KV cache that the engine owns (`KVCache`), so one forward call serves
prefill, decode and speculative verification alike: each sequence brings its own positions, and
attention is masked per sequence. Besides the final normed hidden state it can return the residual
stream before the EAGLE-3 aux layers, which is what the hidden-state tap hands out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position: int = 8192
    tie_embeddings: bool = True
    attention_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def aux_layer_ids(self) -> tuple[int, int, int]:
        """Residual stream taken *before* these decoder layers (vLLM's numbering; SGLang's is one lower)."""
        n = self.num_layers
        low, mid, high = sorted(
            min(max(i, 0), n - 1) for i in (2, n // 2, n - 3)
        )  # clamped for tiny test models
        return (low, mid, high)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        # Llama 3.1 frequency-dependent scaling: long wavelengths are stretched, short ones kept.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif scaling and scaling.get("rope_type", scaling.get("type")) == "linear":
        inv = inv / float(scaling["factor"])
    return inv.float()


class Rope(nn.Module):
    """Rotary embedding (rotate-half layout) with a precomputed cos/sin table indexed by position."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int):
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # (B, T, 1, head_dim) so it broadcasts over heads of a (B, T, H, hd) tensor
        return self.cos[positions].unsqueeze(2).to(dtype), self.sin[positions].unsqueeze(2).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as the reference does; bf16 variance loses the massive activations.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


@dataclass
class KVCache:
    """Keys and values for every layer and slot, allocated once: (layers, slots, kv_heads, capacity, hd)."""

    k: torch.Tensor
    v: torch.Tensor
    _rows: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = field(
        default_factory=dict, repr=False
    )

    @classmethod
    def allocate(
        cls, layers: int, slots: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype
    ) -> KVCache:
        shape = (layers, slots, kv_heads, capacity, head_dim)
        return cls(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def rows(self, slot0: int, count: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each layer's keys and values of the slots [slot0, slot0 + count): views, made once per span."""
        if (slot0, count) not in self._rows:
            end = slot0 + count
            # indexed, not iterated: iterating makes views autograd will not let be written in place
            layers = range(self.k.shape[0])
            self._rows[slot0, count] = (
                [self.k[i, slot0:end] for i in layers],
                [self.v[i, slot0:end] for i in layers],
            )
        return self._rows[slot0, count]


@dataclass
class Batch:
    """Where a forward pass reads and writes: sequences in the contiguous slots [slot0, slot0 + B),
    or, when `slots` is given, in those slots (a gather: only the small draft layer uses it)."""

    slot0: int
    positions: torch.Tensor  # (B, T) absolute positions of the new tokens
    write_positions: torch.Tensor  # (B, T) where their K/V go (padding goes to a scratch position)
    mask: torch.Tensor  # (B, 1, T, L) True where attention is allowed
    kv_len: int  # L: keys [0, L) are read
    slots: torch.Tensor | None = None  # (B,) cache rows when they are not contiguous
    # the mask repeated per query group (`attend`), made once per forward pass instead of per layer
    _grouped: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def grouped_mask(self, groups: int) -> torch.Tensor:
        """(B, 1, groups * T, L): the mask for queries laid out (B, KVH, groups * T, hd)."""
        if groups == 1:
            return self.mask
        if groups not in self._grouped:
            self._grouped[groups] = self.mask.repeat(1, 1, groups, 1)
        return self._grouped[groups]

    @classmethod
    def make(
        cls,
        slot0: int,
        positions: torch.Tensor,
        valid: torch.Tensor | None,
        capacity: int,
        slots: torch.Tensor | None = None,
    ) -> Batch:
        kv_len = int(positions.max().item()) + 1
        keys = torch.arange(kv_len)
        mask = keys.view(1, 1, 1, -1) <= positions.unsqueeze(1).unsqueeze(-1)
        write = positions if valid is None else torch.where(valid, positions, capacity - 1)
        return cls(slot0, positions, write, mask, kv_len, slots)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Grouped-query attention without repeating K/V: q (B, H, T, hd), k/v (B, KVH, L, hd)."""
    b, h, t, hd = q.shape
    kvh = k.shape[1]
    groups = h // kvh
    q = q.reshape(b, kvh, groups * t, hd)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.grouped_mask(groups))
    return out.view(b, h, t, hd).transpose(1, 2).reshape(b, t, h * hd)


def write_kv(cache: torch.Tensor, batch: Batch, x: torch.Tensor) -> torch.Tensor:
    """Store x (B, T, KVH, hd) into a (slots, KVH, cap, hd) cache; return the (B, KVH, L, hd) view to read."""
    if batch.slots is not None:
        cache[batch.slots.unsqueeze(1), :, batch.write_positions] = x
        return cache[batch.slots, :, : batch.kv_len]
    bsz = x.shape[0]
    rows = torch.arange(batch.slot0, batch.slot0 + bsz).unsqueeze(1)
    cache[rows, :, batch.write_positions] = x
    return cache[batch.slot0 : batch.slot0 + bsz, :, : batch.kv_len]


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.h, self.kvh, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.h * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: Batch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.h * self.hd, self.kvh * self.hd, self.kvh * self.hd], -1)
        q = q.view(b, t, self.h, self.hd)
        k = k.view(b, t, self.kvh, self.hd)
        v = v.view(b, t, self.kvh, self.hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        keys = write_kv(k_cache, batch, k)
        values = write_kv(v_cache, batch, v)
        return self.o_proj(attend(q.transpose(1, 2), keys, values, batch))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.inter = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, -1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: Batch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, batch, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """The decoder layers on plain tensors: the batch's, and each layer's cache rows as a tensor of its
    own (written in place). This is the signature `tide.models.aot` exports; the eager path runs the
    same code. Returns the last layer's output and the aux states (the inputs of the aux layers)."""

    def __init__(self, model: LlamaModel):
        super().__init__()
        self.layers, self.rope, self.aux_ids = model.layers, model.rope, model.cfg.aux_layer_ids

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        write_positions: torch.Tensor,
        mask: torch.Tensor,
        ks: list[torch.Tensor],
        vs: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = Batch(0, positions, write_positions, mask, mask.shape[-1])
        rope = self.rope(positions, x.dtype)
        taken: dict[int, torch.Tensor] = {}
        for i, (layer, k, v) in enumerate(zip(self.layers, ks, vs, strict=True)):
            if i in self.aux_ids:
                taken[i] = x
            x = layer(x, rope, batch, k, v)
        return x, torch.cat([taken[i] for i in self.aux_ids], -1)


StackCall = Callable[..., tuple[torch.Tensor, torch.Tensor] | None]


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # (B, T, d) final normed hidden state
    aux: torch.Tensor | None  # (B, T, 3d) residual stream before the aux layers


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        # left uninitialized: weights are always loaded (or set by the caller); normal_ on the meta
        # device the loader builds on costs ~2 s of every start (torch imports its decompositions)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)
        self._stack: list[DecoderStack] = []  # made on first use; a plain list: not a submodule
        # the layers compiled ahead of time (`tide.models.aot`): None for a shape it does not cover
        self.compiled: StackCall | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(self, tokens: torch.Tensor, batch: Batch, cache: KVCache, capture_aux: bool) -> ForwardOutput:
        assert batch.slots is None, "the target reads contiguous slots"
        x = self.embed_tokens(tokens)
        ks, vs = cache.rows(batch.slot0, x.shape[0])
        args = (x, batch.positions, batch.write_positions, batch.mask, ks, vs)
        out = self.compiled(*args) if self.compiled is not None else None
        x, aux = out if out is not None else self.stack(*args)
        return ForwardOutput(self.norm(x), aux if capture_aux else None)

    @property
    def stack(self) -> DecoderStack:
        """The decoder layers as one module (`DecoderStack`), made once the model is built."""
        if not self._stack:
            self._stack.append(DecoderStack(self))
        return self._stack[0]

    @torch.inference_mode()
    def forward_once(self, tokens: torch.Tensor, capture_aux: bool = False) -> ForwardOutput:
        """Whole (B, T) sequences in one pass with a throwaway cache: references and evaluation."""
        b, t = tokens.shape
        positions = torch.arange(t).repeat(b, 1)
        return self(tokens, Batch.make(0, positions, None, t + 1), self.new_cache(b, t + 1), capture_aux)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def new_cache(self, slots: int, capacity: int) -> KVCache:
        c = self.cfg
        # never an inference tensor, wherever it is made: it is written in place outside inference mode too
        with torch.inference_mode(False):
            return KVCache.allocate(c.num_layers, slots, c.num_kv_heads, capacity, c.head_dim, self.dtype)
