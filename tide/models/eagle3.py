"""EAGLE-3 draft head: the one definition that serving and the trainers both import.

Input at position t: the target's residual stream before three layers (2, N/2, N-3) fused by `fc`
(3d -> d), and the target's embedding of token t+1. One decoder layer attends over
cat(input_layernorm(embed), hidden_norm(hidden)) (2d -> q, k, v); its output predicts token t+2
through `norm` and `lm_head` over a reduced draft vocabulary (`d2t`: target_id = draft_id +
d2t[draft_id]; `t2d`: which target ids the draft can say). Further draft steps feed the layer's own
output back as `hidden`. The embedding is the target's and is never saved with the draft.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tide.models.llama import MLP, Batch, LlamaConfig, RMSNorm, Rope, apply_rope, attend, write_kv

DRAFT_FORMAT = "tide-eagle3/1"
SMOKE_TOKENS = 4  # the forward a draft must survive before anything serves or judges it


class DraftMismatchError(ValueError):
    """A draft made for another target (fingerprint, hidden size, aux layers, vocabulary, positions)."""


class DraftLoadError(ValueError):
    """A draft folder that is incomplete, corrupt, inconsistent or holds non-finite weights;
    `reason` labels the refusal for counters (invalid_weights, invalid_config, invalid_vocab, smoke)."""

    def __init__(self, message: str, reason: str = "invalid_weights"):
        super().__init__(message)
        self.reason = reason


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]  # vLLM numbering: residual stream *before* these target layers
    target_fingerprint: str
    version: str = "untrained"
    extra: dict[str, Any] = field(default_factory=dict)  # free-form provenance kept with the draft

    @classmethod
    def for_target(cls, cfg: LlamaConfig, fingerprint: str, draft_vocab_size: int) -> DraftConfig:
        return cls(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rms_eps=cfg.rms_eps,
            rope_theta=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling,
            max_position=cfg.max_position,
            target_vocab_size=cfg.vocab_size,
            draft_vocab_size=min(draft_vocab_size, cfg.vocab_size),
            aux_layer_ids=list(cfg.aux_layer_ids),
            target_fingerprint=fingerprint,
        )

    def check(self) -> None:
        """Refuse values no draft can run with, before anything is built from them (a size of 0 or
        a string makes the modules raise arbitrary errors; an odd head_dim breaks the rotary halves)."""
        problems = []
        sizes = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                 "max_position", "target_vocab_size", "draft_vocab_size")  # fmt: skip
        for name in sizes:
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                problems.append(f"{name} {v!r} is not a positive integer")
        for name in ("rms_eps", "rope_theta"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                problems.append(f"{name} {v!r} is not a positive finite number")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            problems.append(f"rope_scaling {self.rope_scaling!r} is not an object")
        aux = self.aux_layer_ids
        if not isinstance(aux, list) or len(aux) != 3 or not all(_is_int(i) and i >= 0 for i in aux):
            problems.append(f"aux_layer_ids {aux!r} are not three layer ids")
        if not isinstance(self.target_fingerprint, str) or not isinstance(self.version, str):
            problems.append("target_fingerprint and version must be strings")
        if not isinstance(self.extra, dict):
            problems.append("extra must be an object")
        if not problems:
            if self.num_heads % self.num_kv_heads:
                problems.append(f"{self.num_heads} heads do not group over {self.num_kv_heads} kv heads")
            if self.head_dim % 2:
                problems.append(f"head_dim {self.head_dim} is odd (rotary embedding rotates halves)")
            if self.draft_vocab_size > self.target_vocab_size:
                problems.append(
                    f"draft vocabulary {self.draft_vocab_size} > target's {self.target_vocab_size}"
                )
        if problems:
            raise DraftLoadError("bad draft config: " + "; ".join(problems), "invalid_config")

    def check_target(self, cfg: LlamaConfig, fingerprint: str) -> None:
        problems = []
        if self.target_fingerprint != fingerprint:
            problems.append(f"target fingerprint {self.target_fingerprint[:12]} != {fingerprint[:12]}")
        if self.hidden_size != cfg.hidden_size:
            problems.append(f"hidden size {self.hidden_size} != {cfg.hidden_size}")
        if list(self.aux_layer_ids) != list(cfg.aux_layer_ids):
            problems.append(f"aux layers {self.aux_layer_ids} != {list(cfg.aux_layer_ids)}")
        if any(not 0 <= i < cfg.num_layers for i in self.aux_layer_ids):
            problems.append(f"aux layers {self.aux_layer_ids} outside the target's {cfg.num_layers} layers")
        if self.target_vocab_size != cfg.vocab_size:
            problems.append(f"vocabulary {self.target_vocab_size} != {cfg.vocab_size}")
        # the rotary table is sized by it: a shorter one fails at the first position past it, in a
        # serving step; a longer one only costs memory the target can never use
        if self.max_position != cfg.max_position:
            problems.append(f"max position {self.max_position} != {cfg.max_position}")
        if problems:
            raise DraftMismatchError("draft was made for another target: " + "; ".join(problems))


class DraftAttention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.h, self.kvh, self.hd = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.kvh * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.kvh * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, c.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        b, t, _ = x.shape
        q = apply_rope(self.q_proj(x).view(b, t, self.h, self.hd), *rope)
        k = apply_rope(self.k_proj(x).view(b, t, self.kvh, self.hd), *rope)
        v = self.v_proj(x).view(b, t, self.kvh, self.hd)
        return q, k, v


class MidLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.self_attn = DraftAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def attn_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], -1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = hidden + self.self_attn.o_proj(attn_out)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftStep(nn.Module):
    """One draft step on plain tensors (the cache rows of slots [0, B)): the target's embedding of
    the tokens, the decoder layer, and the head's logits at one position per row (`pick`), the one
    the next token is drafted from. The signature `tide.models.aot` exports, so a chain step is one
    call into compiled code; the eager path runs the same code."""

    def __init__(self, draft: Eagle3Draft):
        super().__init__()
        self.midlayer, self.rope, self.norm, self.lm_head = (
            draft.midlayer,
            draft.rope,
            draft.norm,
            draft.lm_head,
        )
        self.embed = draft.embed

    def forward(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_positions: torch.Tensor,
        mask: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pick: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = Batch(0, positions, write_positions, mask, mask.shape[-1])
        return self.run(hidden, tokens, batch, k_cache, v_cache, pick)

    def run(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        batch: Batch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pick: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (B, T, d), tokens (B, T), pick (B,) -> the layer's output (B, T, d) and the fp32
        logits (B, Vd) at position `pick` of each row."""
        layer = self.midlayer
        x = layer.attn_input(self.embed(tokens).to(hidden.dtype), hidden)
        rope = self.rope(batch.positions, x.dtype)
        q, k, v = layer.self_attn.qkv(x, rope)
        keys = write_kv(k_cache, batch, k)
        values = write_kv(v_cache, batch, v)
        out = layer.finish(hidden, attend(q.transpose(1, 2), keys, values, batch))
        at = out.gather(1, pick.view(-1, 1, 1).expand(-1, 1, out.shape[-1]))[:, 0]
        return out, self.lm_head(self.norm(at)).float()


# (step state, hidden, tokens, positions, write_positions, mask, k rows, v rows, pick) -> (output,
# logits), or None
DraftStepCall = Callable[..., tuple[torch.Tensor, torch.Tensor] | None]


@dataclass
class DraftKV:
    """The draft layer's cache: (slots, kv_heads, capacity, hd)."""

    k: torch.Tensor
    v: torch.Tensor


class Eagle3Draft(nn.Module):
    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, cfg: DraftConfig, embed: nn.Embedding):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(3 * d, d, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(d, cfg.rms_eps)
        self.lm_head = nn.Linear(d, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.target_vocab_size, dtype=torch.bool))
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)
        # the target's embedding, shared and frozen: kept out of state_dict()
        self._embed = [embed]
        self._layer: list[DraftStep] = []  # plain lists: not submodules, not in state_dict()
        self._layer_state: dict[str, torch.Tensor] = {}
        # the step compiled ahead of time for this draft's architecture (`tide.models.aot`), set by
        # whoever serves the draft: None for a shape it does not cover
        self.compiled: DraftStepCall | None = None

    @property
    def embed(self) -> nn.Embedding:
        return self._embed[0]

    @property
    def dtype(self) -> torch.dtype:
        """Its activations' dtype (a norm's weight: the linears may be quantized)."""
        return self.norm.weight.dtype

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """Draft vocabulary = these target ids (ascending order is kept, as SpecForge does)."""
        ids = target_ids.sort().values
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_ids(self) -> torch.Tensor:
        return self.draft_to_target(torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device))

    # -- inference, with a KV cache ---------------------------------------------------------------
    def new_cache(self, slots: int, capacity: int, dtype: torch.dtype) -> DraftKV:
        c = self.cfg
        shape = (slots, c.num_kv_heads, capacity, c.head_dim)
        return DraftKV(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    def forward(
        self, hidden: torch.Tensor, tokens: torch.Tensor, batch: Batch, cache: DraftKV
    ) -> torch.Tensor:
        """hidden (B, T, d): fc(aux) or the previous step's output; tokens (B, T): the next tokens.
        (A catch-up or a smoke test: the one row of logits the step also makes is left unused.)"""
        return self.step(hidden, tokens, batch, cache, torch.zeros(hidden.shape[0], dtype=torch.long))[0]

    def step(
        self, hidden: torch.Tensor, tokens: torch.Tensor, batch: Batch, cache: DraftKV, pick: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the logits (B, Vd) at position `pick` (B,) of each row (`DraftStep`)."""
        if batch.slots is not None:  # rows gathered from anywhere in the cache: eager
            return self.layer.run(hidden, tokens, batch, cache.k, cache.v, pick)
        rows = slice(batch.slot0, batch.slot0 + hidden.shape[0])
        args = (
            hidden,
            tokens,
            batch.positions,
            batch.write_positions,
            batch.mask,
            cache.k[rows],
            cache.v[rows],
            pick,
        )
        out = self.compiled(self.layer_state, *args) if self.compiled is not None else None
        return out if out is not None else self.layer(*args)

    @property
    def layer(self) -> DraftStep:
        """Made again where the head is not the draft's own any more (`int4_draft` swaps it in place)."""
        if not self._layer or self._layer[0].lm_head is not self.lm_head:
            self._layer[:] = [DraftStep(self)]
            self._layer_state = {}  # a new dict: a compiled step checks a state once per dict
        return self._layer[0]

    @property
    def layer_state(self) -> dict[str, torch.Tensor]:
        """The tensors `DraftStep` reads, by its names: a compiled step takes them as an input, so
        one package serves every draft of an architecture. Made on first use (after `.to(dtype)`)."""
        layer = self.layer
        if not self._layer_state:
            self._layer_state.update(layer.named_parameters())
            self._layer_state.update(layer.named_buffers())
        return self._layer_state

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out)).float()

    # -- training: training-time test, k unrolled steps ------------------------------------------
    def unrolled(
        self, aux: torch.Tensor, tokens: list[torch.Tensor], positions: torch.Tensor, start: int = 0
    ) -> list[torch.Tensor]:
        """Run len(tokens) draft steps over whole sequences as inference would see them.

        aux (B, L, 3d); tokens[i] (B, L): the token fed at step i for anchor position t (t+1+i);
        positions (B, L). Step i at anchor t sits at position t+i and attends to step-0 keys at
        positions <= t plus its own chain (steps 1..i at the same anchor), exactly the keys the
        inference-time cache holds when that draft token is produced. Returns each step's output:
        step 0 at every anchor (its keys are every later step's context), later steps only at
        anchors >= `start` (B, L - start, d): before it (a prompt) nothing is learnt from them.
        """
        layer = self.midlayer
        b, seq, _ = aux.shape
        hidden = self.fc(aux)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=aux.device).tril()
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        scale = layer.self_attn.hd**-0.5
        for i, tok in enumerate(tokens):
            first = start if i > 0 else 0
            if i == 1:
                hidden, causal = hidden[:, start:], causal[start:]
            n = seq - first
            x = layer.attn_input(self.embed(tok[:, first:]).to(hidden.dtype), hidden)
            pos = positions[:, first:] + i
            rope = self.rope(torch.clamp(pos, max=self.cfg.max_position - 1), x.dtype)
            q, k, v = layer.self_attn.qkv(x, rope)
            kvh, hd = k.shape[2], k.shape[3]
            groups = q.shape[2] // kvh
            q = q.view(b, n, kvh, groups, hd)
            ks.append(k)
            vs.append(v)
            # scores against the step-0 keys (causal) and each chain step's own key (diagonal)
            s0 = torch.einsum("btkgd,bskd->bkgts", q, ks[0]) * scale
            s0 = s0.masked_fill(~causal, float("-inf"))
            diag = [torch.einsum("btkgd,btkd->bkgt", q, kj).unsqueeze(-1) * scale for kj in ks[1:]]
            scores = torch.cat([s0, *diag], -1).float().softmax(-1).to(q.dtype)
            o = torch.einsum("bkgts,bskd->btkgd", scores[..., :seq], vs[0])
            for j, vj in enumerate(vs[1:]):
                o = o + scores[..., seq + j].permute(0, 3, 1, 2).unsqueeze(-1) * vj.unsqueeze(3)
            out = layer.finish(hidden, o.reshape(b, n, -1))
            outs.append(out)
            hidden = out
        return outs

    # -- files ------------------------------------------------------------------------------------
    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": DRAFT_FORMAT})
        cfg = asdict(self.cfg)
        cfg["format"] = DRAFT_FORMAT
        (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    @classmethod
    def load(
        cls,
        folder: str | Path,
        embed: nn.Embedding,
        target_cfg: LlamaConfig,
        fingerprint: str,
        dtype: torch.dtype,
    ) -> Eagle3Draft:
        """A checked draft: config against the target, tensors against the config (shapes, finite
        weights, a vocabulary map exact sampling can use), then a forward on a few tokens."""
        folder = Path(folder)
        cfg = read_config(folder)
        cfg.check_target(target_cfg, fingerprint)
        state = read_state(folder, cfg)
        for name, t in state.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise DraftLoadError(f"{folder}: non-finite values in {name}")
        draft = cls(cfg, embed)
        try:
            draft.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise DraftLoadError(f"{folder}: weights do not fit the config: {e}") from e
        draft = draft.to(dtype).eval()
        draft.smoke_test()
        return draft

    def smoke_test(self, tokens: int = SMOKE_TOKENS) -> None:
        """A first and a chained draft step on a few tokens, as serving runs them: finite weights can
        still overflow (or a config pass every check and fail in a step), and a step that fails
        in serving fails a whole batch."""
        c = self.cfg
        dtype = self.dtype
        g = torch.Generator().manual_seed(0)
        aux = torch.randn(1, tokens, 3 * c.hidden_size, generator=g).to(dtype)
        ids = torch.randint(0, c.target_vocab_size, (2, 1, tokens), generator=g)
        positions = torch.arange(tokens).unsqueeze(0)
        cache = self.new_cache(1, 2 * tokens + 1, dtype)
        try:
            with torch.no_grad():
                out = self(self.fc(aux), ids[0], Batch.make(0, positions, None, 2 * tokens + 1), cache)
                out = self(out, ids[1], Batch.make(0, positions + tokens, None, 2 * tokens + 1), cache)
                logits = self.logits(out)
        except Exception as e:  # whatever a broken draft raises, it is refused, not served
            raise DraftLoadError(
                f"draft {c.version}: a forward on {tokens} tokens failed: {e}", "smoke"
            ) from e
        if logits.shape != (1, tokens, c.draft_vocab_size):
            raise DraftLoadError(f"draft {c.version}: forward gave logits {tuple(logits.shape)}", "smoke")
        if not bool(torch.isfinite(logits).all()):
            raise DraftLoadError(
                f"draft {c.version}: non-finite logits from a forward on {tokens} tokens", "smoke"
            )


def read_folder(folder: Path) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """A draft folder's config and tensors, checked against each other (no target needed)."""
    cfg = read_config(folder)
    return cfg, read_state(folder, cfg)


def read_config(folder: Path) -> DraftConfig:
    """A draft folder's config, every field of a usable type and range. A file that is missing or
    not JSON is the draft's fault (DraftLoadError); a disk that fails to read it is not (OSError)."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (FileNotFoundError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DraftLoadError(f"{folder}: unreadable config.json: {e}", "invalid_config") from e
    if not isinstance(raw, dict) or raw.pop("format", None) != DRAFT_FORMAT:
        raise DraftLoadError(f"{folder}: not a {DRAFT_FORMAT} draft folder", "invalid_config")
    try:
        cfg = DraftConfig(**raw)
    except TypeError as e:
        raise DraftLoadError(f"{folder}: bad config.json: {e}", "invalid_config") from e
    cfg.check()
    return cfg


def read_state(folder: Path, cfg: DraftConfig) -> dict[str, torch.Tensor]:
    """A draft folder's tensors: each of the shape its config implies, and a vocabulary map that
    exact speculative sampling can use (d2t: distinct target ids within the target vocabulary,
    t2d: exactly those)."""
    path = folder / "model.safetensors"
    try:
        state = load_file(str(path))
    except OSError as e:
        if not isinstance(e, FileNotFoundError):
            raise  # the disk, not the draft
        raise DraftLoadError(f"{folder}: no model.safetensors") from e
    except Exception as e:  # safetensors raises several types for truncated or corrupt files
        raise DraftLoadError(f"{folder}: unreadable model.safetensors: {e}") from e
    with torch.device("meta"):  # the shapes the config implies, without allocating them
        try:
            expected = {
                k: tuple(v.shape) for k, v in Eagle3Draft(cfg, nn.Embedding(1, 1)).state_dict().items()
            }
        except Exception as e:  # a config that passed check() but cannot build (a rope_scaling)
            raise DraftLoadError(f"{folder}: config builds no draft: {e}", "invalid_config") from e
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != expected:
        wrong = sorted(k for k in expected.keys() | got.keys() if got.get(k) != expected.get(k))
        detail = ", ".join(f"{k} {got.get(k)} (config: {expected.get(k)})" for k in wrong[:4])
        raise DraftLoadError(f"{folder}: weights do not fit the config: {detail}")
    check_vocab(cfg, state["d2t"], state["t2d"], str(folder))
    return state


def check_vocab(cfg: DraftConfig, d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> None:
    """Draft id i says target id i + d2t[i]: every one must exist and no two may be the same (the
    draft's probabilities are scattered onto target ids, so a duplicate loses mass and exact
    sampling is no longer exact); t2d marks exactly those target ids."""
    if d2t.is_floating_point() or d2t.is_complex() or d2t.dtype == torch.bool:
        raise DraftLoadError(f"{where}: d2t holds {d2t.dtype}, not integers", "invalid_vocab")
    if t2d.dtype != torch.bool:
        raise DraftLoadError(f"{where}: t2d holds {t2d.dtype}, not booleans", "invalid_vocab")
    ids = torch.arange(cfg.draft_vocab_size) + d2t.long()
    outside = (ids < 0) | (ids >= cfg.target_vocab_size)
    if bool(outside.any()):
        raise DraftLoadError(
            f"{where}: d2t maps {int(outside.sum())} draft ids outside the target vocabulary "
            f"[0, {cfg.target_vocab_size})",
            "invalid_vocab",
        )
    if ids.unique().numel() != ids.numel():
        raise DraftLoadError(
            f"{where}: d2t maps {ids.numel() - ids.unique().numel()} draft ids onto target ids already taken",
            "invalid_vocab",
        )
    marked = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
    marked[ids] = True
    if not torch.equal(marked, t2d.cpu()):
        raise DraftLoadError(f"{where}: t2d does not mark exactly the target ids of d2t", "invalid_vocab")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    return -(target_probs * F.log_softmax(logits.float(), -1)).sum(-1)
