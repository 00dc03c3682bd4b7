"""HiddenStateRecord: one chunk of one request's hidden states, as bytes for Kafka.

A record is a safetensors blob whose header metadata carries the schema version, the target
fingerprint, where the chunk sits (workload, request, chunk index, first position) and whether the
request is held out (its records only ever evaluate drafts; the serving node decides). The aux and
final hidden states go through a codec:

- `bf16`: the states as the paper stores them;
- `int8-g64` / `fp8-g64`: group-wise quantization, one bf16 scale per (token, layer, group of 64).
  The residual stream has massive outliers (a few tokens carry most of the norm), so per-row scales
  would flatten every other value to zero; per-group scales keep them.
- `int4-g32`: the aux states as 4-bit codes, two a byte, one bf16 scale per group of 32, and each
  row's `OUTLIERS` largest values kept apart in bf16 (with their channel): with 7 levels a side, one
  massive activation in a group would flatten the other 31. The final state stays `int8-g64`: the
  target's next-token distribution is computed from it, and at 4 bits its KL was 0.02.

The whole blob is then zstd-compressed when that saves at least 5%.

Whoever can write to a topic can send anything, so `decode` trusts nothing: decompression is bounded
whatever a zstd frame declares, and a decoded record is checked (`validate`) against the target and
the topic it came from. Every refusal is a `RecordError` whose `reason` consumers count by.
"""

from __future__ import annotations

import json
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import zstandard
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

SCHEMA_VERSION = "1"
CODECS = ("bf16", "int8-g64", "fp8-g64", "int4-g32")
DEFAULT_CODEC = "int4-g32"  # what nodes publish with, and trainers keep states in, unless told otherwise
GROUP = 64  # int4-g32's groups are half of it: a width any codec quantizes is a multiple of GROUP
GROUP4, OUTLIERS = 32, 8
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_MAX_DECOMPRESSED = 64 << 20  # a record larger than this is not one of ours
_MAX_NAME = 256  # request ids and workload names are short
HELD_OUT_PERCENT = 10  # requests (by id) held out by default: trainers never learn from them


def is_held_out(request_id: str, percent: int = HELD_OUT_PERCENT) -> bool:
    """The default split, by request id (a serving node may hold out more: the record says)."""
    return zlib.crc32(request_id.encode()) % 100 < percent


@dataclass(frozen=True)
class HeldOutWindow:
    """What drafts are judged on, by the trainers and the gate alike: the held-out requests of the
    last `seconds` (after a shift, soon the new traffic), at most `max_positions` completion positions,
    topped up with older ones to `min_positions` (a quiet workload keeps something to measure on; the
    gate decides nothing on fewer). Serving nodes hold out more while fewer of this window's requests are."""

    seconds: float = 120.0
    max_positions: int = 1536
    min_positions: int = 256


class RecordError(ValueError):
    """A message that is not a usable record; consumers count these by `reason` and skip them."""

    reason: ClassVar[str] = "corrupt"


class CorruptRecord(RecordError):
    """The bytes are not a record (not safetensors, a broken zstd frame, fields missing)."""


class OversizedRecord(CorruptRecord):
    """Decompresses (or its zstd frame says it would) to more than any record of ours."""

    reason = "oversized"


class SchemaMismatch(RecordError):
    reason = "schema"


class ForeignTarget(RecordError):
    """A record made by another target model: its states mean nothing to this draft."""

    reason = "foreign"


class InvalidRecord(RecordError):
    """Decodes, but its content cannot be trained on (a field out of range)."""

    reason = "invalid"


class WrongShape(InvalidRecord):
    """State widths that are not the target's (or aux not three times the final state)."""

    reason = "shape"


class TokenOutOfRange(InvalidRecord):
    """A token id outside [0, vocab size): it would index past the embedding and the LM head."""

    reason = "token_range"


class NonFiniteState(InvalidRecord):
    """An inf or NaN in the states: one such value turns every weight of a draft trained on it NaN."""

    reason = "non_finite"


class WrongWorkload(InvalidRecord):
    """A record naming another workload than its topic's: it would train the wrong draft."""

    reason = "workload"


REFUSAL_REASONS = tuple(
    c.reason
    for c in (CorruptRecord, OversizedRecord, SchemaMismatch, ForeignTarget, InvalidRecord, WrongShape,
              TokenOutOfRange, NonFiniteState, WrongWorkload)
)  # fmt: skip


@dataclass(frozen=True)
class TargetShape:
    """What a record's content must fit of the target the reader trains for."""

    hidden_size: int
    vocab_size: int


@dataclass
class HiddenStateRecord:
    tokens: torch.Tensor  # (m + 1,) the tokens at positions first_position ... first_position + m
    aux: torch.Tensor  # (m, 3d) residual stream before the three aux layers
    hidden: torch.Tensor  # (m, d) final normed hidden state
    prefill: torch.Tensor  # (m,) bool: position of the prompt (True) or of an accepted token
    target_fingerprint: str
    draft_version: str
    workload: str
    request_id: str
    chunk: int
    first_position: int
    last: bool  # the request's final chunk
    held_out: bool = False  # only ever evaluates drafts: trainers never learn from it
    created_at: float = field(default_factory=time.time)

    @property
    def num_positions(self) -> int:
        return len(self.aux)

    def __post_init__(self) -> None:
        m = len(self.aux)
        if self.tokens.shape != (m + 1,) or self.hidden.shape[0] != m or self.prefill.shape != (m,):
            raise ValueError(
                f"inconsistent record: tokens {tuple(self.tokens.shape)}, aux {tuple(self.aux.shape)}, "
                f"hidden {tuple(self.hidden.shape)}, prefill {tuple(self.prefill.shape)}"
            )


# -- codecs -----------------------------------------------------------------------------------------
def _quantize(x: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """(m, n) with n a multiple of GROUP -> codes and one fp16 scale per row and group."""
    m, n = x.shape
    g = x.float().reshape(m, n // GROUP, GROUP)
    absmax = g.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    top = 127.0 if kind == "int8-g64" else 448.0  # 448: the largest float8-e4m3 value
    # scales are stored in bf16 (fp16 would underflow on quiet groups); quantizing with the rounded
    # scale makes decoding see exactly what encoding used
    scale16 = (absmax / top).to(torch.bfloat16)
    scaled = g / scale16.float()
    if kind == "int8-g64":
        codes = torch.round(scaled).clamp_(-127, 127).to(torch.int8)
    else:
        codes = scaled.clamp_(-448, 448).to(torch.float8_e4m3fn)
    return {"codes": codes.reshape(m, n).view(torch.int8), "scales": scale16.reshape(m, n // GROUP)}


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, kind: str) -> torch.Tensor:
    m, n = codes.shape
    if scales.shape != (m, n // GROUP):  # it would broadcast
        raise ValueError(f"scales {tuple(scales.shape)} for codes {tuple(codes.shape)}")
    values = codes.float() if kind == "int8-g64" else codes.view(torch.float8_e4m3fn).float()
    return (values.reshape(m, n // GROUP, GROUP) * scales.float().unsqueeze(-1)).reshape(m, n)


def _quantize4(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """(m, n) with n a multiple of GROUP4 -> each row's OUTLIERS largest values and their channels,
    then the rest as 4-bit codes (two a byte) with one bf16 scale per row and group."""
    m, n = x.shape
    xf = x.float()
    idx = xf.abs().topk(min(OUTLIERS, n), dim=1).indices
    kept = xf.gather(1, idx).to(torch.bfloat16)
    g = xf.scatter(1, idx, 0.0).reshape(m, n // GROUP4, GROUP4)
    scale16 = (g.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 7.0).to(torch.bfloat16)
    codes = (torch.round(g / scale16.float()).clamp_(-7, 7) + 8).to(torch.uint8).reshape(m, n)
    return {
        "codes": codes[:, 0::2] | (codes[:, 1::2] << 4),
        "scales": scale16.reshape(m, n // GROUP4),
        "outlier_channels": idx.to(torch.int16),
        "outliers": kept,
    }


def _dequantize4(t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    packed = t[f"{name}.codes"]
    m, half = packed.shape
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(m, 2 * half).float() - 8.0
    scales = t[f"{name}.scales"].float()
    if scales.shape != (m, 2 * half // GROUP4):  # it would broadcast
        raise ValueError(f"{name}: scales {tuple(scales.shape)} for codes {tuple(packed.shape)}")
    x = (codes.reshape(m, -1, GROUP4) * scales.unsqueeze(-1)).reshape(m, 2 * half)
    # a channel out of range fails the scatter, which the caller reports as a corrupt record
    return x.scatter_(1, t[f"{name}.outlier_channels"].long(), t[f"{name}.outliers"].float())


def _part_codec(name: str, codec: str) -> str:
    """The codec a record's `codec` applies to its part `name` (aux or hidden)."""
    return "int8-g64" if codec == "int4-g32" and name == "hidden" else codec


def encode_tensor(name: str, x: torch.Tensor, codec: str) -> dict[str, torch.Tensor]:
    codec = _part_codec(name, codec)
    if codec == "bf16" or x.shape[-1] % GROUP:
        return {name: x.to(torch.bfloat16).contiguous()}
    q = _quantize4(x) if codec == "int4-g32" else _quantize(x, codec)
    return {f"{name}.{k}": v.contiguous() for k, v in q.items()}


def decode_tensor(t: dict[str, torch.Tensor], name: str, codec: str) -> torch.Tensor:
    if name in t:
        return t[name]
    codec = _part_codec(name, codec)
    if codec == "int4-g32":
        return _dequantize4(t, name).to(torch.bfloat16)
    return _dequantize(t[f"{name}.codes"], t[f"{name}.scales"], codec).to(torch.bfloat16)


# -- bytes ------------------------------------------------------------------------------------------
def encode(record: HiddenStateRecord, codec: str = DEFAULT_CODEC, zstd: bool = True) -> bytes:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    tensors = {
        "tokens": record.tokens.to(torch.int32).contiguous(),
        "prefill": record.prefill.to(torch.uint8).contiguous(),
        **encode_tensor("aux", record.aux, codec),
        **encode_tensor("hidden", record.hidden, codec),
    }
    meta = {
        "schema": SCHEMA_VERSION,
        "codec": codec,
        "target_fingerprint": record.target_fingerprint,
        "draft_version": record.draft_version,
        "workload": record.workload,
        "request_id": record.request_id,
        "chunk": str(record.chunk),
        "first_position": str(record.first_position),
        "last": "1" if record.last else "0",
        "held_out": "1" if record.held_out else "0",
        "created_at": repr(record.created_at),
    }
    blob = st_save(tensors, metadata=meta)
    if zstd:
        packed = zstandard.ZstdCompressor(level=3).compress(blob)
        if len(packed) < 0.95 * len(blob):
            return packed
    return blob


def _held_out(meta: dict[str, str]) -> bool:
    if "held_out" not in meta:  # a node from before the field: the split by id it was made under
        return is_held_out(meta["request_id"])
    if meta["held_out"] not in ("0", "1"):  # guessing could train on what only evaluates
        raise ValueError(f"held_out is {meta['held_out'][:16]!r}, not 0 or 1")
    return meta["held_out"] == "1"


def _decompress(data: bytes) -> bytes:
    """A zstd frame's content, never more than `_MAX_DECOMPRESSED` bytes of memory: a frame that
    declares more is refused from its header (a one-shot decompress allocates what the frame
    declares: an 8 KB frame took 256 MiB, and one declaring 1 TiB raised MemoryError); one that
    does not say is streamed and cut off past the cap."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise CorruptRecord(f"not a zstd frame header: {e}") from None
    if declared > _MAX_DECOMPRESSED:
        raise OversizedRecord(f"zstd frame declares {declared} bytes, more than {_MAX_DECOMPRESSED}")
    chunks: list[bytes] = []
    total = 0
    try:
        # the window bounds the decoder's own buffer, which a frame header also chooses
        dctx = zstandard.ZstdDecompressor(max_window_size=_MAX_DECOMPRESSED)
        with dctx.stream_reader(data) as reader:
            while chunk := reader.read(1 << 20):
                total += len(chunk)
                if total > _MAX_DECOMPRESSED:
                    raise OversizedRecord(f"zstd frame decompresses to more than {_MAX_DECOMPRESSED} bytes")
                chunks.append(chunk)
    except zstandard.ZstdError as e:
        raise CorruptRecord(f"zstd frame does not decompress: {e}") from None
    if declared >= 0 and total != declared:
        raise CorruptRecord(f"zstd frame declares {declared} bytes, holds {total}")
    return b"".join(chunks)


def decode(
    data: bytes,
    expect_fingerprint: str | None = None,
    shape: TargetShape | None = None,
    workload: str | None = None,
) -> HiddenStateRecord:
    """Bytes -> record; raises a RecordError subclass for anything that is not a record we can use:
    also, with `shape` and `workload` (its topic's), for content that does not fit them (`validate`)."""
    if data[:4] == _ZSTD_MAGIC:
        data = _decompress(data)
    try:
        tensors = st_load(data)
        meta = _metadata(data)
    except (SafetensorError, ValueError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptRecord(f"not a safetensors record: {e}") from None
    if meta.get("schema") != SCHEMA_VERSION:
        raise SchemaMismatch(f"record schema {meta.get('schema')!r}, this reader knows {SCHEMA_VERSION!r}")
    if expect_fingerprint is not None and meta.get("target_fingerprint") != expect_fingerprint:
        raise ForeignTarget(
            f"record made by target {str(meta.get('target_fingerprint'))[:16]}…, "
            f"expected {expect_fingerprint[:16]}…"
        )
    codec = meta.get("codec", "")
    try:
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}")
        record = HiddenStateRecord(
            tokens=tensors["tokens"].long(),
            aux=decode_tensor(tensors, "aux", codec),
            hidden=decode_tensor(tensors, "hidden", codec),
            prefill=tensors["prefill"].bool(),
            target_fingerprint=meta["target_fingerprint"],
            draft_version=meta["draft_version"],
            workload=meta["workload"],
            request_id=meta["request_id"],
            chunk=int(meta["chunk"]),
            first_position=int(meta["first_position"]),
            last=meta["last"] == "1",
            held_out=_held_out(meta),
            created_at=float(meta["created_at"]),
        )
    except (KeyError, ValueError, RuntimeError, TypeError, IndexError) as e:  # e.g. a 0-d tensor's len()
        raise CorruptRecord(f"record fields are missing or inconsistent: {e}") from None
    validate(record, shape, workload)
    return record


def validate(
    record: HiddenStateRecord, shape: TargetShape | None = None, workload: str | None = None
) -> None:
    """Refuse (a RecordError) a record a trainer could not learn from safely: states that are not
    two-dimensional and three aux layers wide (of the target's width, given `shape`), token ids
    outside [0, vocab size), inf or NaN anywhere, fields out of range, or another workload's name
    than `workload` (its topic's)."""
    aux, hidden = record.aux, record.hidden
    if aux.dim() != 2 or hidden.dim() != 2 or aux.shape[1] != 3 * hidden.shape[1]:
        raise WrongShape(
            f"states aux {tuple(aux.shape)}, hidden {tuple(hidden.shape)}: not (m, 3d) and (m, d)"
        )
    if shape is not None and hidden.shape[1] != shape.hidden_size:
        raise WrongShape(f"states {hidden.shape[1]} wide, the target's are {shape.hidden_size}")
    if not aux.is_floating_point() or not hidden.is_floating_point():
        raise WrongShape(f"states of {aux.dtype} and {hidden.dtype}, not floating point")
    tokens = record.tokens
    vocab = shape.vocab_size if shape is not None else None
    if len(tokens) and (int(tokens.min()) < 0 or (vocab is not None and int(tokens.max()) >= vocab)):
        raise TokenOutOfRange(f"token ids {int(tokens.min())}..{int(tokens.max())}, vocab size {vocab}")
    if not (bool(torch.isfinite(aux).all()) and bool(torch.isfinite(hidden).all())):
        raise NonFiniteState("inf or NaN in the states")
    if record.chunk < 0 or record.first_position < 0 or not math.isfinite(record.created_at):
        raise InvalidRecord(
            f"chunk {record.chunk}, first position {record.first_position}, created at {record.created_at}"
        )
    if not 0 < len(record.request_id) <= _MAX_NAME or not 0 < len(record.workload) <= _MAX_NAME:
        raise InvalidRecord("request id or workload name empty or too long")
    if workload is not None and record.workload != workload:
        raise WrongWorkload(f"a record of workload {record.workload[:64]!r} in {workload!r}'s topic")


def _metadata(blob: bytes) -> dict[str, str]:
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict):
        raise ValueError("bad metadata")
    return {str(k): str(v) for k, v in meta.items()}
