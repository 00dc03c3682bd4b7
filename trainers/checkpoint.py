"""A trainer's durable state: draft, optimizer, replay buffer and held-out set (their states in a
record codec, as the records carried them) and the ledger.

The ledger lists the (request id, chunk) pairs whose training the checkpoint holds, with the next
offset of every partition read. A checkpoint is a fresh folder `ckpt-<steps>`; `CURRENT` names the
newest complete one and is replaced atomically, so a trainer killed at any moment restarts from a
consistent state. Offsets are committed to Kafka only after `CURRENT` points at a checkpoint that
holds them: records read after the last checkpoint are delivered again, and records the checkpoint
already holds are recognised by the ledger and skipped. The ledger remembers the newest
`Ledger.trim` keys only (a record older than that, delivered again, would be trained again), and a
checkpoint is never written with non-finite weights: a resume would refuse them forever.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator, MutableSet
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tide.models.eagle3 import Eagle3Draft
from tide.producers.records import CODECS, DEFAULT_CODEC, decode_tensor, encode_tensor
from tide.trainers.ttt import Example


class KeySet(MutableSet[str]):
    """A set that remembers the order keys were added in, so the oldest can be forgotten."""

    def __init__(self, keys: Iterable[str] = ()):
        self._keys = dict.fromkeys(keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: str) -> None:
        self._keys[key] = None

    def discard(self, key: str) -> None:
        self._keys.pop(key, None)

    def drop_oldest(self, n: int) -> None:
        for key in list(self._keys)[: max(0, n)]:
            del self._keys[key]

    def __repr__(self) -> str:
        return f"KeySet({list(self._keys)!r})"


@dataclass
class Ledger:
    trained: KeySet = field(default_factory=KeySet)  # "request_id:chunk" held by the checkpoint, oldest first
    offsets: dict[str, int] = field(default_factory=dict)  # "topic:partition" -> next offset to read
    steps: int = 0
    records: int = 0
    redeliveries: int = 0
    skipped: int = 0  # messages refused by the consumer (this session), by reason in `refused`
    refused: dict[str, int] = field(default_factory=dict)
    candidates: int = 0
    best_tau: float = 0.0  # held-out tau of the last candidate
    first_offsets: dict[str, int] = field(default_factory=dict)  # where this workload's training began
    forgotten: int = 0  # keys dropped from `trained` by `trim`: records = len(trained) + forgotten
    nonfinite_steps: int = 0  # steps skipped because their loss or gradients were inf or NaN
    reverts: int = 0  # times the weights went non-finite and were put back to the last checkpoint's
    outages: int = 0  # calls to MLflow or Kafka that failed (each retried later, with backoff)

    def trim(self, keep: int) -> None:
        """Remember only the newest `keep` trained keys (retention: the ledger is saved whole)."""
        extra = len(self.trained) - keep
        if extra > 0:
            self.trained.drop_oldest(extra)
            self.forgotten += extra

    def to_json(self) -> str:
        d = asdict(self)
        d["trained"] = list(self.trained)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> Ledger:
        d = json.loads(text)
        d["trained"] = KeySet(d["trained"])
        return cls(**d)


def finite_weights(draft: Eagle3Draft) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in draft.state_dict().values() if t.is_floating_point())


@dataclass
class Checkpoint:
    ledger: Ledger
    draft_dir: Path
    optimizer: dict[str, object] | None
    replay: list[Example]
    held_out: list[Example]


def save_checkpoint(
    root: Path, ledger: Ledger, draft: Eagle3Draft, optimizer: torch.optim.Optimizer, replay: list[Example],
    held_out: list[Example], codec: str = DEFAULT_CODEC,
) -> Path:  # fmt: skip
    if not finite_weights(draft):  # a resume would refuse them (Eagle3Draft.load), every time
        raise ValueError("the draft's weights are not finite: refusing to checkpoint them")
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"ckpt-{ledger.steps:09d}-{ledger.records:09d}"
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    draft.save(tmp / "draft")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if replay:
        save_examples(replay, tmp / "replay.safetensors", codec)
    if held_out:
        save_examples(held_out, tmp / "held_out.safetensors", codec)
    (tmp / "ledger.json").write_text(ledger.to_json())
    _fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    current = root / ".CURRENT.tmp"
    current.write_text(final.name)
    _fsync(current)
    os.replace(current, root / "CURRENT")
    for old in root.glob("ckpt-*"):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoints_dir(state_dir: Path) -> Path:
    """Where a trainer with this `--state-dir` keeps its checkpoints."""
    return state_dir / "checkpoints"


def current_checkpoint(root: Path) -> Path | None:
    pointer = root / "CURRENT"
    return root / pointer.read_text().strip() if pointer.exists() else None


def _read_ledger(folder: Path) -> Ledger:
    return Ledger.from_json((folder / "ledger.json").read_text())


def load_ledger(root: Path) -> Ledger | None:
    """The current checkpoint's ledger alone (what an audit reads; a resume reads everything)."""
    folder = current_checkpoint(root)
    return _read_ledger(folder) if folder else None


def load_checkpoint(root: Path) -> Checkpoint | None:
    folder = current_checkpoint(root)
    if folder is None:
        return None
    ledger = _read_ledger(folder)
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    replay = load_examples(folder / "replay.safetensors") if (folder / "replay.safetensors").exists() else []
    held = (
        load_examples(folder / "held_out.safetensors") if (folder / "held_out.safetensors").exists() else []
    )
    return Checkpoint(ledger, folder / "draft", optimizer, replay, held)


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            _fsync(p)


def save_examples(examples: list[Example], path: Path, codec: str = "bf16") -> None:
    """Keep collected hidden states so training can be rerun without the target: in a record codec
    (`producers/records.py`), named in the file's metadata."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    tensors: dict[str, torch.Tensor] = {}
    for i, ex in enumerate(examples):
        tensors[f"{i}.tokens"] = ex.tokens
        tensors.update(encode_tensor(f"{i}.aux", ex.aux, codec))
        tensors.update(encode_tensor(f"{i}.hidden", ex.hidden, codec))
        tensors[f"{i}.best"] = ex.best
        tensors[f"{i}.learn_from"] = torch.tensor([ex.learn_from])
        tensors[f"{i}.created_at"] = torch.tensor([ex.created_at], dtype=torch.float64)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"examples": str(len(examples)), "codec": codec})


def load_examples(path: Path) -> list[Example]:
    """What `save_examples` kept, in whichever codec (files from before codecs hold bf16 states)."""
    with safe_open(str(path), "pt") as f:
        codec = (f.metadata() or {}).get("codec", "bf16")
    if codec not in CODECS:
        raise ValueError(f"{path}: unknown codec {codec!r}")
    t = load_file(str(path))
    n = len({k.split(".")[0] for k in t})
    return [
        Example(
            t[f"{i}.tokens"],
            decode_tensor(t, f"{i}.aux", codec),
            decode_tensor(t, f"{i}.hidden", codec),
            t[f"{i}.best"],
            int(t[f"{i}.learn_from"][0]),
            float(t[f"{i}.created_at"][0]) if f"{i}.created_at" in t else 0.0,
        )
        for i in range(n)
    ]
