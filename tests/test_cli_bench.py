"""The `tide` command end to end: bench report keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tide.cli import app
from tide.config import native_dtype

from .conftest import WORKLOADS


def test_bench_spec_report(trained_draft_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    args = ["bench", "spec", "--prompts", str(WORKLOADS / "code.jsonl"), "--draft", str(trained_draft_dir),
            "--max-new-tokens", "24", "--batch-size", "2", "--limit", "4", "--gamma", "3", "--no-llama-cpp",
            "--proposer", "hybrid", "--out", str(out), "--plot", str(tmp_path / "spec.png")]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    r = json.loads(out.read_text())
    assert (tmp_path / "spec.png").stat().st_size > 1000
    for key in (
        "speedup",
        "predicted_speedup",
        "greedy_match_rate",
        "greedy_identical",
        "tap_overhead",
        "dtype",
        "batch_size",
        "gamma",
    ):
        assert key in r, key
    assert r["baseline"]["tokens_per_s"] > 0 and r["speculative"]["tokens_per_s"] > 0
    assert len(r["speculative"]["accept_rate_by_depth"]) == 3
    assert r["speculative"]["mean_accept_length"] >= 1.0
    assert (
        0 <= r["greedy_match_rate"] <= 1
        and r["dtype"] == str(native_dtype()).removeprefix("torch.")
        and r["batch_size"] == 2
    )
    assert len(r["divergence_top2_logit_gaps"]) == round((1 - r["greedy_match_rate"]) * r["prompts"])
    assert r["predicted_speedup"] > 0 and 0 <= r["tap_overhead"] < 1
    assert r["adaptive_speedup"] > 0 and 0 < r["adaptive"]["drafted_share"] <= 1
    # the hybrid proposer beside the draft alone, on the same prompts, with each source's share
    h = r["proposer"]
    assert h["name"] == "hybrid" and h["tokens_per_s"] > 0 and r["proposer_over_draft"] > 0
    assert (
        0 <= h["suffix_share"] <= 1
        and 0 <= h["draft_share"] <= 1
        and h["suffix_share"] + h["draft_share"] > 0
    )
    assert 0 <= r["proposer_greedy_match_rate"] <= 1  # bf16 parts at near-ties; fp32 is test_lossless's
    # and the same proposer under the controller, as `tide serve --gamma auto --proposer hybrid` runs it
    a = r["adaptive_proposer"]
    assert a["name"] == "hybrid" and a["tokens_per_s"] > 0 and r["adaptive_proposer_speedup"] > 0
    assert len(r["adaptive_proposer_speedup_by_group"]) == 1 and 0 <= a["suffix_share"] <= 1


def test_an_unknown_proposer_is_refused() -> None:
    for cmd in (["serve"], ["bench", "spec", "--prompts", "x.jsonl", "--draft", "d"]):
        res = CliRunner().invoke(app, [*cmd, "--proposer", "oracle"])
        assert res.exit_code == 2 and "draft, suffix, hybrid" in res.output, res.output


def test_a_topic_that_keeps_nothing_is_refused() -> None:
    for keep in ("0", "-1.5"):
        res = CliRunner().invoke(app, ["bench", "training", "--prompts", "x.jsonl", "--keep-slices", keep])
        assert res.exit_code == 2 and "--keep-slices" in res.output, res.output


@pytest.mark.slow  # starts a real server
def test_bench_records_report(tmp_path: Path) -> None:
    out = tmp_path / "records.json"
    args = ["bench", "records", "--prompts", str(WORKLOADS / "chat_fr.jsonl"), "--limit", "5",
            "--max-new-tokens", "24", "--train-steps", "4", "--out", str(out), "--plot", str(tmp_path / "r.png")]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    r = json.loads(out.read_text())
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert set(r["codecs"]) == {"bf16", "int8-g64", "fp8-g64", "int4-g32"}
    raw = r["raw_bf16_bytes_per_token"]
    assert raw > 4 * 576 * 2  # three aux states and the final one, in bf16, per position
    bf16, int8, fp8 = (r["codecs"][c] for c in ("bf16", "int8-g64", "fp8-g64"))
    assert bf16["lossless"] and bf16["rel_error_p95"] == 0 and bf16["draft_tau_ratio"] == 1.0
    for q in (int8, fp8):
        assert q["bytes_per_token"] < 0.6 * raw and not q["lossless"]
        assert 0 < q["rel_error_median"] <= q["rel_error_p95"] < 0.1
        assert q["target_kl"] >= 0 and q["draft_tau_ratio"] > 0
    int4 = r["codecs"]["int4-g32"]
    assert int4["bytes_per_token"] < int8["bytes_per_token"] and 0 < int4["rel_error_p95"] < 0.3
    assert int4["target_kl"] == pytest.approx(int8["target_kl"])  # the same final-state codec
    assert r["tokens_per_s_off"] > 0
    for row in r["codecs"].values():  # each codec's capture was measured publishing to the broker
        assert -1 < row["capture_overhead"] < 1 and row["capture_records_lost"] == 0
        low, high = row["capture_overhead_range"]
        assert low <= row["capture_overhead"] <= high  # the median over rounds, with its spread


@pytest.mark.slow  # starts a real server
def test_bench_training_report(tmp_path: Path) -> None:
    out = tmp_path / "training.json"
    args = ["bench", "training", "--prompts", str(WORKLOADS / "code.jsonl"), "--requests", "16",
            "--slice-requests", "8", "--max-new-tokens", "24", "--out", str(out)]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    r = json.loads(out.read_text())
    assert r["positions"] > 500 and r["training_steps"] > 0 and r["records_lost_to_retention"] == 0
    assert r["tide_seconds"] == r["tide_decode_seconds"] + r["tide_label_seconds"] + r["tide_train_seconds"]
    assert 0 < r["decode_share"] < 1 and r["baseline_prefill_seconds"] > 0 and r["speedup"] > 0
    assert r["tide_tau"] >= 1 and r["baseline_tau"] >= 1
    assert r["storage_bytes_offline"] == r["positions"] * 4 * 576 * 2
    assert r["storage_bytes_tide"] == r["storage_topic_peak_bytes"] + r["storage_replay_peak_bytes"] > 0
    assert 1.5 < r["codec_factor"] < 4  # int8 with group scales, zstd
    # sized from the rate the trainer measured: one partition keeps a slice and a half of it
    assert r["topic"]["partitions"] == 1 and r["traffic_bytes_per_s"] > 0
    assert r["topic"]["retention_bytes"] >= r["topic"]["segment_bytes"] >= 1 << 20


def test_bench_shift_report(trained_draft_dir: Path, tmp_path: Path) -> None:
    """Two 20 s phases of `tide bench shift` with the whole loop: Kafka, MLflow, trainer, gate, and
    the suffix index beside the draft."""
    out, plot = tmp_path / "shift.json", tmp_path / "shift.png"
    schedule = f"{WORKLOADS / 'code.jsonl'},{WORKLOADS / 'chat_fr.jsonl'}"
    args = ["bench", "shift", "--schedule", schedule, "--static-draft", str(trained_draft_dir),
            "--phase-seconds", "20", "--slot-seconds", "2", "--window-seconds", "10", "--max-new-tokens", "24",
            "--proposer", "hybrid", "--work-dir", str(tmp_path / "work"), "--out", str(out), "--plot", str(plot)]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    r = json.loads(out.read_text())
    assert plot.stat().st_size > 1000
    assert [p["workload"] for p in r["phases"]] == ["code", "chat_fr"]
    for p in r["phases"]:
        assert p["nospec_tokens_per_s"] > 0 and p["static_vs_nospec"] > 0 and p["tide_vs_nospec"] > 0
        assert p["tide_window_p10"] <= p["tide_window_median"]
        assert {
            "adapt_seconds",
            "promotions",
            "recalls",
            "recovery_seconds",
            "tide_end_vs_nospec",
        } <= p.keys()
    assert len(r["windows"]) == 4 and r["controller"]["default"]["alpha"]
    assert all(0 <= w["tide_drafted_share"] + w["tide_suffix_share"] <= 1 for w in r["windows"])
    assert r["config"]["proposer"] == "hybrid" and all(0 <= p["tide_suffix_share"] <= 1 for p in r["phases"])
    # gamma auto: each drafted step proposed 1..6 tokens (None: a window where TIDE never drafted)
    assert all(w["tide_mean_gamma"] is None or 1 <= w["tide_mean_gamma"] <= 6 for w in r["windows"])
    assert all(isinstance(w["tide_controller"]["shifted"], bool) for w in r["windows"])
