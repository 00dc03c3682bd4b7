"""A trainer's durable state: draft, optimizer, replay buffer, held-out set and the ledger.

The ledger lists the (request id, chunk) pairs whose training the checkpoint holds, with the next
offset of every partition read. A checkpoint is a fresh folder `ckpt-<steps>`; `CURRENT` names the
newest complete one and is replaced atomically, so a trainer killed at any moment restarts from a
consistent state. Offsets are committed to Kafka only after `CURRENT` points at a checkpoint that
holds them: records read after the last checkpoint are delivered again, and records the checkpoint
already holds are recognised by the ledger and skipped.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tide.models.eagle3 import Eagle3Draft
from tide.trainers.bootstrap import load_examples, save_examples
from tide.trainers.ttt import Example


@dataclass
class Ledger:
    trained: set[str] = field(default_factory=set)  # "request_id:chunk" held by the checkpoint
    offsets: dict[str, int] = field(default_factory=dict)  # "topic:partition" -> next offset to read
    steps: int = 0
    records: int = 0
    redeliveries: int = 0
    skipped: int = 0
    candidates: int = 0
    best_tau: float = 0.0  # held-out tau of the last candidate
    first_offsets: dict[str, int] = field(default_factory=dict)  # where this workload's training began

    def to_json(self) -> str:
        d = asdict(self)
        d["trained"] = sorted(self.trained)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> Ledger:
        d = json.loads(text)
        d["trained"] = set(d["trained"])
        return cls(**d)


@dataclass
class Checkpoint:
    ledger: Ledger
    draft_dir: Path
    optimizer: dict[str, object] | None
    replay: list[Example]
    held_out: list[Example]


def save_checkpoint(
    root: Path, ledger: Ledger, draft: Eagle3Draft, optimizer: torch.optim.Optimizer, replay: list[Example],
    held_out: list[Example],
) -> Path:  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"ckpt-{ledger.steps:09d}-{ledger.records:09d}"
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    draft.save(tmp / "draft")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if replay:
        save_examples(replay, tmp / "replay.safetensors")
    if held_out:
        save_examples(held_out, tmp / "held_out.safetensors")
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


def load_checkpoint(root: Path) -> Checkpoint | None:
    pointer = root / "CURRENT"
    if not pointer.exists():
        return None
    folder = root / pointer.read_text().strip()
    ledger = Ledger.from_json((folder / "ledger.json").read_text())
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
