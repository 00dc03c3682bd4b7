"""Draft folders: round trip, and refusal of drafts made for another target or damaged on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tide.models.eagle3 import DraftLoadError, DraftMismatchError, Eagle3Draft
from tide.serving.engine import Engine, EngineConfig

from .conftest import tiny_draft, tiny_target


def _saved(tmp_path: Path):
    target = tiny_target(seed=21)
    draft = tiny_draft(target, seed=22, vocab=100)
    draft.cfg.version = "v1"
    draft.save(tmp_path / "d")
    return target, draft, tmp_path / "d"


def _load(target, folder: Path) -> Eagle3Draft:
    return Eagle3Draft.load(
        folder, target.model.embed_tokens, target.config, target.fingerprint, torch.float32
    )


def test_round_trip(tmp_path: Path) -> None:
    target, draft, folder = _saved(tmp_path)
    loaded = _load(target, folder)
    assert loaded.cfg == draft.cfg
    for k, v in draft.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    assert "embed_tokens.weight" not in load_file(str(folder / "model.safetensors"))
    assert torch.equal(loaded.target_ids(), draft.target_ids())


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("target_fingerprint", "0" * 64, "fingerprint"),
        ("hidden_size", 32, "hidden size"),
        ("aux_layer_ids", [0, 0, 0], "aux layers"),
        ("target_vocab_size", 999, "vocabulary"),
    ],
)
def test_refuses_a_draft_for_another_target(tmp_path: Path, field: str, value: object, needle: str) -> None:
    target, _, folder = _saved(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg[field] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftMismatchError, match=needle):
        _load(target, folder)


def test_refuses_nan_weights_and_corrupt_files(tmp_path: Path) -> None:
    target, _, folder = _saved(tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    state["fc.weight"][0, 0] = float("nan")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "tide-eagle3/1"})
    with pytest.raises(DraftLoadError, match="non-finite"):
        _load(target, folder)
    (folder / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(DraftLoadError, match="unreadable"):
        _load(target, folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(DraftLoadError):
        _load(target, folder)


def test_a_refused_draft_leaves_the_engine_on_its_old_one(tmp_path: Path) -> None:
    target, _, folder = _saved(tmp_path)
    engine = Engine(target, None, EngineConfig(max_batch=2, max_model_len=32, gamma=2))
    engine.load_draft(folder)
    engine.step()
    assert engine.draft_version == "v1"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(
        (folder / "config.json").read_text().replace(target.fingerprint, "f" * 64)
    )
    (bad / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(DraftMismatchError):
        engine.load_draft(bad)
    engine.step()
    assert engine.draft_version == "v1"
