"""How the target's linear layers hold their weights: `--weights bf16|int8|int4|gguf`.

| mode | decoder linears | kernel |
| --- | --- | --- |
| `bf16` | dense, in the serving dtype (bf16, or fp32 where bf16 is emulated) | oneDNN, prepacked |
| `int8` | int8, one scale per output row | `aten._weight_int8pack_mm` |
| `int4` | int4 in groups of 32 along the input (scale and zero per group) | `aten._weight_int4pack_mm_for_cpu` |
| `gguf` | the GGUF file's own Q4_0/Q4_1 blocks, unchanged | as `int4` |

A decode step reads every weight once, so fewer bytes per weight is fewer bytes per token. The LM
head (the tied embedding) stays dense in every mode: 4 bits there cost the most agreement with
fp32, and int8 was no faster there than oneDNN's bf16 (`docs/experiments.md`). Q4_1 stores a block
of 32 weights as w = d * q + m with q in 0..15; torch's int4 kernel computes w = (q - 8) * scale +
zero, so scale = d and zero = m + 8d (Q4_0: w = d * (q - 8), zero 0). Weights are quantized once at
load; activations stay in the serving dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from torch import nn

WEIGHT_MODES = ("auto", "bf16", "int8", "int4", "gguf")
WEIGHTS_HELP = (
    "the target's linears: gguf (the file's own 4-bit blocks), int4, int8, bf16 (dense), or auto: "
    "gguf where the file holds Q4_0/Q4_1 blocks, bf16 otherwise"
)
INT4_GROUP = 32  # GGUF's block size; torch's int4 kernel takes it as its group size
M = TypeVar("M", bound=nn.Module)
_INNER_K_TILES = 8  # torch's int4 packing for CPU; the kernel reads it back from the packed shape


class Int8Linear(nn.Module):
    """Weight-only int8 with one scale per output row (symmetric)."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        w = weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.qweight, self.scale)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


@dataclass
class Int4Blocks:
    """A (N, K) weight as 4-bit codes q (0..15) in groups of `INT4_GROUP` along K, with w = (q - 8) * scale + zero."""

    q: torch.Tensor  # (N, K) uint8
    scale: torch.Tensor  # (N, K / group) fp32
    zero: torch.Tensor  # (N, K / group) fp32

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Blocks:
        """Asymmetric min-max per group (the rule GGUF's Q4_1 uses)."""
        n, k = weight.shape
        g = weight.detach().float().reshape(n, k // INT4_GROUP, INT4_GROUP)
        low, high = g.amin(-1), g.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = ((g - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        return cls(q.reshape(n, k), scale, low + 8 * scale)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.reshape(n, k // INT4_GROUP, INT4_GROUP).float() - 8
        return (q * self.scale[..., None] + self.zero[..., None]).reshape(n, k)


class Int4Linear(nn.Module):
    """Weight-only int4 in groups of 32 through torch's CPU int4 kernel."""

    qweight: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(self, blocks: Int4Blocks, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = blocks.q.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q.to(torch.int32), _INNER_K_TILES)
        self.register_buffer("qweight", packed)
        # (K / group, N, 2): the kernel's layout of scales and zeros
        sz = torch.stack([blocks.scale, blocks.zero], -1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", sz.to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, self.in_features), self.qweight, INT4_GROUP, self.scales_and_zeros
        )
        y = y.view(
            *x.shape[:-1], y.shape[-1]
        )  # the weight's rows: a compiled draft head's vocabulary is dynamic
        return y if self.bias is None else y + self.bias


def int4_available(linear: nn.Linear) -> bool:
    """The kernel's sizes: whole groups along the input, outputs in 16s (its packing)."""
    return (
        linear.in_features % INT4_GROUP == 0
        and linear.out_features % 16 == 0
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    )


def int4_draft(draft: M) -> M:
    """A draft's linears in int4 (in place), where the kernel takes their size. A draft step reads
    13 MB of bf16 weights for a few million multiply-adds: bound by memory even beside the target,
    so a quarter of the bytes is most of the time (`docs/experiments.md`). Its tokens are only
    proposals (the target verifies every one), so its precision moves acceptance, never the output."""

    def int4(_: str, linear: nn.Linear) -> nn.Module | None:
        if not int4_available(linear):
            return None
        return Int4Linear(Int4Blocks.quantize(linear.weight), linear.bias, linear.weight.dtype)

    return _swap_linears(draft, int4)


def _swap_linears(root: M, make: Callable[[str, nn.Linear], nn.Module | None]) -> M:
    """Each nn.Linear under `root` replaced (in place) by `make(its name, it)`; None keeps it."""
    for name, module in list(root.named_modules()):
        if isinstance(module, nn.Linear) and (new := make(name, module)) is not None:
            parent, _, attr = name.rpartition(".")
            setattr(root.get_submodule(parent), attr, new)
    return root


# -- the GGUF's own blocks ----------------------------------------------------------------------------

# GGUF linear names -> the fused linear (and row offset within it) they go into
_GGUF_LINEARS = {
    "attn_q": ("self_attn.qkv_proj", 0),
    "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", 0),
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}


class GGUFBlockError(ValueError):
    pass


def _blocks_of(data: np.ndarray, kind: str, rows: int, cols: int) -> Int4Blocks:
    """Q4_0 (d: f16, 16 bytes of codes) or Q4_1 (d, m: f16, 16 bytes): element j of a block is the low
    nibble of byte j for j < 16, the high nibble of byte j - 16 after."""
    size = 18 if kind == "Q4_0" else 20
    raw = np.ascontiguousarray(data).reshape(rows, cols // INT4_GROUP, size)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = raw[..., size - 16 :]
    q = np.concatenate([codes & 0x0F, codes >> 4], -1).reshape(rows, cols)
    if kind == "Q4_0":
        zero = np.zeros_like(d)
    else:
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    return Int4Blocks(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero))


def _unpermute_rows(b: Int4Blocks, n_head: int) -> Int4Blocks:
    """llama.cpp stores q/k rows interleaved for its RoPE; ours are rotate-half (`loader._unpermute`)."""

    def un(t: torch.Tensor) -> torch.Tensor:
        rows = t.shape[0]
        return t.reshape(n_head, rows // n_head // 2, 2, -1).transpose(1, 2).reshape(t.shape)

    return Int4Blocks(un(b.q), un(b.scale), un(b.zero))


def read_gguf_blocks(path: Path, heads: int, kv_heads: int) -> dict[str, Int4Blocks]:
    """Each decoder linear of a GGUF file as its own 4-bit blocks, fused as the model fuses them
    (`layers.{i}.self_attn.qkv_proj`, ...). Raises GGUFBlockError where a linear is stored otherwise."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    parts: dict[str, list[tuple[int, Int4Blocks]]] = {}
    for t in reader.tensors:
        bits = t.name.split(".")
        if len(bits) != 4 or bits[0] != "blk" or bits[2] not in _GGUF_LINEARS or bits[3] != "weight":
            continue
        kind = t.tensor_type.name
        if kind not in ("Q4_0", "Q4_1"):
            raise GGUFBlockError(
                f"{path.name}: {t.name} is {kind}; --weights gguf serves Q4_0/Q4_1 blocks (use --weights int4)"
            )
        cols, rows = (int(s) for s in t.shape)
        blocks = _blocks_of(t.data, kind, rows, cols)
        if arch == "llama" and bits[2] in ("attn_q", "attn_k"):
            blocks = _unpermute_rows(blocks, heads if bits[2] == "attn_q" else kv_heads)
        name, order = _GGUF_LINEARS[bits[2]]
        parts.setdefault(f"layers.{bits[1]}.{name}", []).append((order, blocks))
    fused: dict[str, Int4Blocks] = {}
    for name, pieces in parts.items():
        pieces.sort(key=lambda p: p[0])
        fused[name] = Int4Blocks(
            *(torch.cat([getattr(b, f) for _, b in pieces]) for f in ("q", "scale", "zero"))
        )
    return fused


# -- applying a mode ----------------------------------------------------------------------------------


def quantize_linears(model: nn.Module, mode: str, gguf_path: Path | None = None) -> str:
    """Replace the target's decoder linears (in place) by the mode's; `bf16` leaves them to
    `pack_linears`. Returns the mode applied (`auto` resolved)."""
    from tide.models.llama import LlamaModel

    if mode not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {mode!r}")
    assert isinstance(model, LlamaModel)
    file_blocks: dict[str, Int4Blocks] = {}
    if mode in ("gguf", "auto") and gguf_path is not None and gguf_path.suffix == ".gguf":
        try:
            file_blocks = read_gguf_blocks(gguf_path, model.cfg.num_heads, model.cfg.num_kv_heads)
        except GGUFBlockError:
            if mode == "gguf":
                raise
    elif mode == "gguf":
        raise GGUFBlockError("--weights gguf needs a gguf model file")
    if mode == "auto":  # the file's own 4 bits where it has them: the fastest mode, and no requantizing
        mode = "gguf" if file_blocks else "bf16"
    if mode == "bf16":
        return "bf16"
    dtype = model.dtype

    def quantized(name: str, linear: nn.Linear) -> nn.Module:
        w, b = linear.weight, linear.bias
        if mode == "int8" or not int4_available(linear):
            return Int8Linear(w, b, dtype)
        if mode == "gguf":
            key = f"layers.{name}"  # the file's names are the model's
            if key not in file_blocks:
                raise GGUFBlockError(f"{gguf_path}: no 4-bit blocks for {key}")
            return Int4Linear(file_blocks[key], b, dtype)
        return Int4Linear(Int4Blocks.quantize(w), b, dtype)

    _swap_linears(model.layers, quantized)
    return mode
