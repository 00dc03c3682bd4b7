"""The online trainer's pure parts: the recency window (positions, seconds) of held-out examples, the
replay batch, the draft vocabulary picked after a shift (and what it is fitted to), and the offline
draft's data collection."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tide.producers.records import CODECS, decode_tensor, encode_tensor
from tide.trainers.checkpoint import load_examples, save_examples
from tide.trainers.examples import keep_recent, turned_over
from tide.trainers.replay import ReplayBuffer
from tide.trainers.ttt import Example, select_vocab
from tide.trainers.vocab import grown_vocab, newest_uncovered


def _example(tokens: list[int], learn_from: int = 0, created_at: float = 0.0) -> Example:
    n = len(tokens)
    return Example.make(
        torch.tensor(tokens), torch.zeros(n, 6), torch.zeros(n, 2), None, learn_from, created_at
    )


def test_keep_recent_keeps_the_newest_positions() -> None:
    examples = [_example([i] * 10) for i in range(5)]
    kept = keep_recent(examples, 25)
    assert [int(e.tokens[0]) for e in kept] == [3, 4]  # 20 positions; a third example would make 30
    assert keep_recent(examples, 3) == examples[-1:]  # the newest one always stays
    assert keep_recent([], 10) == []
    # prompt positions are not counted: an evaluation only measures completions
    prompted = [_example([i] * 10, learn_from=8) for i in range(5)]
    assert len(keep_recent(prompted, 6)) == 3


def test_keep_recent_follows_the_traffic_of_the_last_seconds() -> None:
    examples = [_example([i] * 10, created_at=100.0 * i) for i in range(6)]  # one every 100 s
    times = [e.created_at for e in keep_recent(examples, 1000, newer_than=350.0)]
    assert times == [400.0, 500.0]  # a shift at 350 s: only what came after it
    # too little since then: the newest older ones fill up to the floor
    times = [e.created_at for e in keep_recent(examples, 1000, newer_than=450.0, floor=30)]
    assert times == [300.0, 400.0, 500.0]
    assert keep_recent(examples, 1000, newer_than=900.0) == examples[-1:]  # the newest always stays


def test_replay_leans_on_the_newest_examples() -> None:
    # 1,000 examples of an old workload, then 50 of a new one: a twentieth of the buffer
    examples = [_example([0] * 4) for _ in range(1000)] + [_example([1] * 4) for _ in range(50)]
    buffer = ReplayBuffer(2000, examples)
    drawn = [int(e.tokens[0]) for _ in range(200) for e in buffer.batch(4, 64)]
    assert len(drawn) == 1600
    share = sum(drawn) / len(drawn)  # the newest 64 hold all 50 new ones: half of 50/64, plus 50/1050
    assert 0.36 < share < 0.46, share
    assert len(ReplayBuffer(2000, examples[:3]).batch(4, 64)) == 6  # a small buffer: what there is
    assert len(ReplayBuffer(100, examples)) == 100  # the oldest go


def test_the_replay_buffer_keeps_states_at_half_their_size() -> None:
    torch.manual_seed(0)
    n, d = 40, 128
    ex = Example.make(
        torch.arange(n), torch.randn(n, 3 * d).bfloat16(), torch.randn(n, d).bfloat16(), None, 5, 7.0
    )
    buffer = ReplayBuffer(10, [ex], "int8-g64")
    (back,) = buffer.examples()
    assert back.tokens.equal(ex.tokens) and (back.learn_from, back.created_at) == (5, 7.0)
    for a, b in ((back.aux, ex.aux), (back.hidden, ex.hidden)):
        # int8 codes, one scale per 64 values: off by at most half a step of the group's largest
        # value, plus the rounding of the rebuilt value to bf16
        g = b.float().reshape(n, -1, 64)
        step = g.abs().amax(-1, keepdim=True) / 127
        assert ((a.float().reshape(n, -1, 64) - g).abs() <= step * 0.51 + g.abs() / 128 + 1e-6).all()
    kept = sum(t.nbytes for t in buffer._kept[0].states.values())
    assert kept < 0.53 * (ex.aux.nbytes + ex.hidden.nbytes)
    (bare,) = buffer.bare()
    assert bare.aux.numel() == 0 and bare.tokens.equal(ex.tokens)


def test_vocabulary_after_a_shift_keeps_older_words_as_filler() -> None:
    new = [_example([90, 91, 91, 92, 92, 92], learn_from=1)]  # token 90 is the prompt
    old = [_example([5, 5, 5, 6, 6, 7])]
    ids = select_vocab(new, 6, 100, fill=old).tolist()
    # the new completions first, then the new prompt, then the old traffic by frequency
    assert ids == sorted([92, 91, 90, 5, 6, 7])
    assert select_vocab(new, 4, 100, fill=old).tolist() == sorted([92, 91, 90, 5])
    assert select_vocab(new, 5, 100).tolist() == [0, 1, 90, 91, 92]  # no filler: lowest unused ids
    # then the draft's own vocabulary before any unused id: a few positions do not name a whole vocabulary
    assert select_vocab(new, 5, 100, keep=torch.tensor([40, 41, 91])).tolist() == [40, 41, 90, 91, 92]


def test_shift_bench_repeats_keep_their_prompts_split() -> None:
    from tide.bench.shift import request_id
    from tide.producers.records import is_held_out

    ids = [request_id("code.jsonl", i, 10) for i in range(50)]
    assert len(set(ids)) == 50
    for i in range(10, 50):  # a prompt that comes again is held out exactly when its first request was
        assert is_held_out(ids[i]) == is_held_out(ids[i % 10])


def test_the_vocabulary_is_refitted_to_the_traffic_that_moved_it() -> None:
    covered = torch.zeros(100, dtype=torch.bool)
    covered[:50] = True  # the old workload's words
    old = [_example([1, 2, 3, 4, 60], learn_from=1) for _ in range(6)]  # 3 of 4 covered
    new = [_example([70, 71, 72, 3, 73], learn_from=1) for _ in range(4)]  # 1 of 4
    prompt_only = _example([80, 81], learn_from=2)  # says nothing about coverage: kept
    window = [*old, *new[:2], prompt_only, *new[2:]]
    assert newest_uncovered(window, covered, 0.7, 8) == window[len(old) :]
    # too few new positions to fit a vocabulary to: the whole window
    assert newest_uncovered(window, covered, 0.7, 17) == window
    assert newest_uncovered(old, covered, 0.7, 1) == old


def test_the_vocabulary_grows_with_the_traffic_it_was_first_fitted_to() -> None:
    covered = torch.zeros(100, dtype=torch.bool)
    covered[[1, 2, 60, 61]] = True  # fitted to the new traffic's first request, which said 60 and 61
    earlier = [_example([0, 60, 61, 62, 63], learn_from=1), _example([0, 62, 63, 64], learn_from=1)]
    newest = [_example([0, 60, 62, 63, 64], learn_from=1)]
    # a fit to `earlier` (60-63) says 3 of the newest 4 completion tokens, the draft's 1: refit to all
    ids = grown_vocab(earlier, newest, covered, 4, 100, None, 0.02)
    assert ids is not None and ids.tolist() == [60, 62, 63, 64]  # as many words as the draft has
    # 11 positions read of the traffic: not yet twice the 6 the draft's vocabulary was fitted to
    assert grown_vocab(earlier, newest, covered, 6, 100, None, 0.02) is None
    # a vocabulary already as good as a fit to what came before: no refit (nor a fresh optimiser)
    covered[:] = False
    covered[[1, 60, 62, 63]] = True  # 3 of 4, as the trial fit
    assert grown_vocab(earlier, newest, covered, 4, 100, None, 0.02) is None
    assert grown_vocab(earlier, newest, covered, 4, 100, None, 0.0) is not None
    assert grown_vocab([], newest, covered, 0, 100, None, 0.0) is None  # nothing to fit to


def test_a_candidate_is_published_again_once_the_held_out_set_has_turned_over() -> None:
    # 30 held-out positions from before the last candidate, then 10 with 2 prompt positions each
    held_out = [_example([1] * 10, created_at=t) for t in (10.0, 20.0, 30.0)]
    held_out += [_example([2] * 12, learn_from=2, created_at=t) for t in (50.0, 60.0, 70.0)]
    assert turned_over(held_out, 40.0, 0.5)  # 30 of 60 completion positions are new
    assert not turned_over(held_out, 55.0, 0.5)  # 20 of 60
    assert turned_over(held_out, 55.0, 0.3)
    assert not turned_over(held_out, 80.0, 0.0)  # nothing new: nothing to judge again
    assert not turned_over([], 0.0, 0.5)


def test_skipping_prompt_anchors_changes_neither_loss_nor_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unrolled steps after the first run only from the earliest anchor a completion needs: the
    same loss, gradients and greedy-chain counts as running them over the prompts too."""
    from tide.trainers import ttt

    monkeypatch.setattr(ttt, "SHAPE_STEP", 1)  # the start as it is, not rounded down to 0

    from .conftest import tiny_draft, tiny_target

    target = tiny_target()
    head = target.model.lm_head.weight.detach()
    g = torch.Generator().manual_seed(0)
    examples = []
    for n, learn_from in ((40, 25), (33, 12), (28, 20)):  # prompts of different lengths in one batch
        toks = torch.randint(0, 256, (n,), generator=g)
        aux, hidden = torch.randn(n, 3 * 64, generator=g), torch.randn(n, 64, generator=g)
        examples.append(Example.make(toks, aux, hidden, head, learn_from))
    batch = ttt.collate(examples, 10**9)
    assert ttt.learn_start(batch["learn"], 4) == 8  # the earliest completion (12) less 4 steps

    def run() -> tuple[float, list[torch.Tensor], torch.Tensor, torch.Tensor]:
        draft = tiny_draft(target, seed=3).train()
        loss, corrects, valids = ttt.ttt_forward(draft, head, batch, 4, 0.8)
        loss.backward()
        accepted, anchors = ttt.chain_accepted(corrects, valids)
        return (
            float(loss.detach()),
            [p.grad.clone() for p in draft.parameters() if p.grad is not None],
            accepted,
            anchors,
        )

    skipped = run()
    monkeypatch.setattr(ttt, "learn_start", lambda learn, steps: 0)
    full = run()
    assert abs(skipped[0] - full[0]) < 1e-5 * abs(full[0])
    assert len(skipped[1]) == len(full[1]) > 0
    for a, b in zip(skipped[1], full[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert torch.equal(skipped[2], full[2]) and torch.equal(skipped[3], full[3])


def test_padding_to_shape_steps_changes_neither_loss_nor_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches padded to a multiple of SHAPE_STEP (and a first anchor rounded down) train exactly as
    unpadded ones: the padding is masked and causal attention never looks ahead to it."""
    from tide.trainers import ttt

    from .conftest import tiny_draft, tiny_target

    target = tiny_target()
    head = target.model.lm_head.weight.detach()
    g = torch.Generator().manual_seed(1)
    examples = []
    for n, learn_from in ((45, 30), (37, 20)):
        toks = torch.randint(0, 256, (n,), generator=g)
        aux, hidden = torch.randn(n, 3 * 64, generator=g), torch.randn(n, 64, generator=g)
        examples.append(Example.make(toks, aux, hidden, head, learn_from))

    def run(step: int) -> tuple[int, float, list[torch.Tensor], torch.Tensor]:
        monkeypatch.setattr(ttt, "SHAPE_STEP", step)
        batch = ttt.collate(examples, 10**9)
        draft = tiny_draft(target, seed=3).train()
        loss, corrects, valids = ttt.ttt_forward(draft, head, batch, 4, 0.8)
        loss.backward()
        accepted, _ = ttt.chain_accepted(corrects, valids)
        grads = [p.grad.clone() for p in draft.parameters() if p.grad is not None]
        return batch["tokens"].shape[1], float(loss.detach()), grads, accepted

    exact, padded = run(1), run(32)
    assert (exact[0], padded[0]) == (45, 64)
    assert abs(exact[1] - padded[1]) < 1e-5 * abs(exact[1])
    for a, b in zip(exact[2], padded[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert torch.equal(exact[3].sum(0), padded[3].sum(0))


def test_tau_per_step_walks_the_chain_as_serving_does() -> None:
    """A step starts where the last one's tokens end: a long accepted run counts once, not once per
    position it covers, as `chain_tau` counts it."""
    from tide.trainers import ttt

    # the chain accepts 2, 0, 1, 3, 0, 0 drafts from positions 0..5; position 6 is padding
    truth = torch.tensor([[2, 0, 1, 3, 0, 0, 0]])
    valid = torch.tensor([[True] * 6 + [False]])
    corrects = [truth > d for d in range(4)]
    valids = [valid] * 4
    lengths = ttt.chain_lengths(corrects, valids)
    assert lengths.tolist() == [[2, 0, 1, 3, 0, 0, 0]]
    assert ttt.served_steps(lengths, valid, 2) == (6, 2)  # 2 kept at 0, then 2 of 3 at 3
    assert ttt.served_steps(lengths, valid, 1) == (6, 4)  # at 0, 2, 4 and 5
    per_position = 1 + sum(min(m, 2) for m in [2, 0, 1, 3, 0, 0]) / 6
    assert abs(per_position - 11 / 6) < 1e-9 < 6 / 2 - per_position  # here the steps land on the runs


def test_collecting_a_drafts_data_keeps_at_most_one_batch_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests admitted past one batch would all be finished after the generation deadline, in the
    training's share of the budget (on a busy machine, all of it)."""
    from tests.conftest import tiny_target
    from tide.bootstrap import BootstrapConfig, collect
    from tide.serving.engine import Engine

    target = tiny_target()
    in_flight: list[int] = []
    add = Engine.add

    def counting_add(self: Engine, *args: Any, **kw: Any) -> Any:
        in_flight.append(len(self.running) + len(self.waiting) + 1)
        return add(self, *args, **kw)

    monkeypatch.setattr(Engine, "add", counting_add)
    cfg = BootstrapConfig(gen_batch=3, max_new_tokens=8)
    # the tiny model has no tokenizer: prompts that are token ids already
    target.tokenizer = SimpleNamespace()  # type: ignore[assignment]
    prompts = [SimpleNamespace(token_ids=lambda _tok, i=i: [1 + i, 2, 3, 4]) for i in range(10)]
    examples = collect(target, prompts, cfg, deadline=time.monotonic() + 600)  # type: ignore[arg-type]
    assert len(examples) == 10
    assert max(in_flight) == 3


@pytest.mark.parametrize("codec", CODECS)
def test_saved_examples_keep_their_states_in_a_record_codec(codec: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    n, d = 40, 128
    aux = torch.randn(n, 3 * d).bfloat16()
    ex = Example.make(torch.arange(n), aux, torch.randn(n, d).bfloat16(), None, 5, 7.0)
    two = [ex, Example.make(ex.tokens.clone(), aux.clone(), ex.hidden.clone(), None, 5, 7.0)]
    save_examples(two, tmp_path / "x.safetensors", codec)
    back = load_examples(tmp_path / "x.safetensors")
    assert (
        len(back) == 2
        and back[1].tokens.equal(ex.tokens)
        and (back[1].learn_from, back[1].created_at) == (5, 7.0)
    )
    # what a record in this codec would have carried, to the bit
    want = {"aux": decode_tensor(encode_tensor("aux", aux, codec), "aux", codec)}
    assert back[0].aux.equal(want["aux"]) and back[0].aux.dtype == torch.bfloat16
    raw = (tmp_path / "x.safetensors").stat().st_size
    save_examples(two, tmp_path / "bf16.safetensors")
    assert raw <= (tmp_path / "bf16.safetensors").stat().st_size
    if codec == "int4-g32":
        assert raw < 0.4 * (tmp_path / "bf16.safetensors").stat().st_size


def test_examples_saved_before_codecs_still_load(tmp_path: Path) -> None:
    """A checkpoint from an older trainer: bf16 states and no codec in the metadata."""
    n = 4
    aux, hidden = torch.randn(n, 6).bfloat16(), torch.randn(n, 2).bfloat16()
    old = {"0.tokens": torch.arange(n), "0.aux": aux, "0.hidden": hidden, "0.best": torch.empty(0, dtype=torch.long),
           "0.learn_from": torch.tensor([1])}  # fmt: skip
    save_file(old, str(tmp_path / "old.safetensors"), metadata={"examples": "1"})
    (back,) = load_examples(tmp_path / "old.safetensors")
    assert back.aux.equal(aux) and back.hidden.equal(hidden) and back.created_at == 0.0


def test_examples_in_an_unknown_codec_are_refused(tmp_path: Path) -> None:
    save_file({"0.tokens": torch.arange(2)}, str(tmp_path / "x.safetensors"), metadata={"codec": "int2"})
    with pytest.raises(ValueError, match="unknown codec"):
        load_examples(tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="unknown codec"):
        save_examples([], tmp_path / "y.safetensors", "int2")
    with pytest.raises(ValueError, match="unknown codec"):
        ReplayBuffer(4, [], "int2")


def test_the_replay_buffer_keeps_states_in_its_codec() -> None:
    torch.manual_seed(0)
    n, d = 40, 128
    ex = Example.make(
        torch.arange(n), torch.randn(n, 3 * d).bfloat16(), torch.randn(n, d).bfloat16(), None, 5
    )
    sizes = {c: sum(t.nbytes for t in ReplayBuffer(4, [ex], c)._kept[0].states.values()) for c in CODECS}
    assert sizes["int4-g32"] < sizes["int8-g64"] < sizes["bf16"]
    (back,) = ReplayBuffer(4, [ex], "int4-g32").examples()
    assert back.aux.equal(decode_tensor(encode_tensor("aux", ex.aux, "int4-g32"), "aux", "int4-g32"))
