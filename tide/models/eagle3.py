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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tide.models.llama import MLP, Batch, LlamaConfig, RMSNorm, Rope, apply_rope, attend, write_kv

DRAFT_FORMAT = "tide-eagle3/1"


class DraftMismatchError(ValueError):
    """A draft made for another target (fingerprint, hidden size, aux layers or vocabulary)."""


class DraftLoadError(ValueError):
    """A draft folder that is incomplete, corrupt or holds non-finite weights."""


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

    def check_target(self, cfg: LlamaConfig, fingerprint: str) -> None:
        problems = []
        if self.target_fingerprint != fingerprint:
            problems.append(f"target fingerprint {self.target_fingerprint[:12]} != {fingerprint[:12]}")
        if self.hidden_size != cfg.hidden_size:
            problems.append(f"hidden size {self.hidden_size} != {cfg.hidden_size}")
        if list(self.aux_layer_ids) != list(cfg.aux_layer_ids):
            problems.append(f"aux layers {self.aux_layer_ids} != {list(cfg.aux_layer_ids)}")
        if self.target_vocab_size != cfg.vocab_size:
            problems.append(f"vocabulary {self.target_vocab_size} != {cfg.vocab_size}")
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

    @property
    def embed(self) -> nn.Embedding:
        return self._embed[0]

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
        """hidden (B, T, d): fc(aux) or the previous step's output; tokens (B, T): the next tokens."""
        layer = self.midlayer
        x = layer.attn_input(self.embed(tokens).to(hidden.dtype), hidden)
        rope = self.rope(batch.positions, x.dtype)
        q, k, v = layer.self_attn.qkv(x, rope)
        keys = write_kv(cache.k, batch, k)
        values = write_kv(cache.v, batch, v)
        return layer.finish(hidden, attend(q.transpose(1, 2), keys, values, batch.mask))

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
        folder = Path(folder)
        cfg, state = read_folder(folder)
        cfg.check_target(target_cfg, fingerprint)
        for name, t in state.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise DraftLoadError(f"{folder}: non-finite values in {name}")
        draft = cls(cfg, embed)
        try:
            draft.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise DraftLoadError(f"{folder}: weights do not fit the config: {e}") from e
        return draft.to(dtype).eval()


def read_folder(folder: Path) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """A draft folder's config and raw tensors, checked only for being readable (no target needed)."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftLoadError(f"{folder}: unreadable config.json: {e}") from e
    if raw.pop("format", None) != DRAFT_FORMAT:
        raise DraftLoadError(f"{folder}: not a {DRAFT_FORMAT} draft folder")
    try:
        cfg = DraftConfig(**raw)
    except TypeError as e:
        raise DraftLoadError(f"{folder}: bad config.json: {e}") from e
    try:
        state = load_file(str(folder / "model.safetensors"))
    except Exception as e:  # safetensors raises several types for truncated or corrupt files
        raise DraftLoadError(f"{folder}: unreadable model.safetensors: {e}") from e
    return cfg, state


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    return -(target_probs * F.log_softmax(logits.float(), -1)).sum(-1)
