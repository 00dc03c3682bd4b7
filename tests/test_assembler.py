"""A request's records are joined back into the request they were cut from; gaps and stragglers
come out as the pieces they are."""

from __future__ import annotations

import dataclasses

import torch

from tide.producers.assembler import RequestAssembler, join, record_key
from tide.producers.records import HiddenStateRecord

D = 4


def _request(
    n: int, chunk: int, prompt: int, rid: str = "r"
) -> tuple[HiddenStateRecord, list[HiddenStateRecord]]:
    """A request of n positions as one record, and cut as the publisher cuts it (overlapping by a token)."""
    whole = HiddenStateRecord(
        tokens=torch.arange(n + 1),
        aux=torch.randn(n, 3 * D),
        hidden=torch.randn(n, D),
        prefill=torch.arange(n) < prompt,
        target_fingerprint="f",
        draft_version="v1",
        workload="code",
        request_id=rid,
        chunk=0,
        first_position=0,
        last=True,
    )
    starts = list(range(0, n, chunk))
    parts = [
        HiddenStateRecord(
            tokens=whole.tokens[s : min(n, s + chunk) + 1],
            aux=whole.aux[s : s + chunk],
            hidden=whole.hidden[s : s + chunk],
            prefill=whole.prefill[s : s + chunk],
            target_fingerprint="f",
            draft_version="v1",
            workload="code",
            request_id=rid,
            chunk=i,
            first_position=s,
            last=i == len(starts) - 1,
            created_at=whole.created_at + i,
        )
        for i, s in enumerate(starts)
    ]
    return whole, parts


def _same(a: HiddenStateRecord, b: HiddenStateRecord) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "aux", "hidden", "prefill"))


def test_the_records_of_a_request_join_into_it_whatever_other_requests_come_between() -> None:
    whole_a, a = _request(150, 64, prompt=40, rid="a")
    whole_b, b = _request(70, 64, prompt=10, rid="b")
    asm = RequestAssembler()
    out = [r for rec in (a[0], b[0], a[1], a[1], b[1], a[2]) for r in asm.add(rec)]  # a[1] twice
    assert [r.request_id for r in out] == ["b", "a"]
    assert _same(out[0], whole_b) and _same(out[1], whole_a)
    assert out[1].first_position == 0 and out[1].last and out[1].created_at == a[0].created_at
    assert not asm.pending


def test_a_missing_chunk_leaves_two_pieces_and_a_silent_request_is_flushed_when_stale() -> None:
    _, parts = _request(200, 64, prompt=30)
    asm = RequestAssembler(stale_seconds=0.0)
    assert asm.add(parts[0], "t:0", 10) == [] and asm.add(parts[1], "t:0", 11) == []
    assert asm.holding() == {"t:0": 10} and asm.keys() == {record_key(parts[0]), record_key(parts[1])}
    pieces = asm.add(parts[3], "t:0", 13)  # chunk 2 was dropped on the way: 0-1 come out, 3 is the last
    assert len(pieces) == 2
    assert _same(pieces[0], join(parts[:2])) and pieces[0].num_positions == 128
    assert pieces[1].first_position == parts[3].first_position and pieces[1].last
    assert asm.add(parts[0]) == [] and [r.request_id for r in asm.flush()] == ["r"]
    assert asm.holding() == {} and asm.flush(everything=True) == []


def test_a_record_that_does_not_fit_the_held_ones_starts_a_piece_instead_of_breaking_the_join() -> None:
    _, parts = _request(150, 64, prompt=40)
    wide = HiddenStateRecord(torch.arange(65), torch.randn(64, 3 * 2 * D), torch.randn(64, 2 * D),
                             torch.zeros(64, dtype=torch.bool), "f", "v1", "code", "r", 1, 64, False)  # fmt: skip
    asm = RequestAssembler()
    assert asm.add(parts[0]) == []
    pieces = asm.add(wide)  # the same request id and the next chunk, other widths: joining them would raise
    assert len(pieces) == 1 and _same(pieces[0], parts[0])
    held_out = [dataclasses.replace(p, request_id="h", held_out=i == 1) for i, p in enumerate(parts)]
    assert asm.add(held_out[0]) == []
    (piece,) = asm.add(held_out[1])  # a join never mixes what trains with what only evaluates
    assert _same(piece, held_out[0]) and not piece.held_out


def test_the_assembler_holds_a_bounded_number_of_requests_and_positions() -> None:
    asm = RequestAssembler(max_pending=3, max_positions=128)
    firsts = [_request(150, 64, prompt=40, rid=f"r{i}")[1][0] for i in range(5)]
    out = [r.request_id for rec in firsts for r in asm.add(rec)]
    assert out == ["r0", "r1"] and len(asm.pending) == 3  # the requests untouched for longest went on
    _, long = _request(400, 64, prompt=40, rid="long")
    pieces = [r for rec in long[:3] for r in asm.add(rec)]
    assert [r.num_positions for r in pieces if r.request_id == "long"] == [128]  # two chunks: at the bound
