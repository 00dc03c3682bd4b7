"""`tide bench records`: what each record codec costs in bytes, in fidelity, and in draft quality;
and what capture with publishing costs the serving engine.

The target answers the prompts once; its tapped states are the raw data. Each codec's records are
encoded and decoded exactly as they travel through Kafka. Fidelity is judged three ways: relative
L2 error per token and layer, KL between the target's next-token distribution from the original
and from the decoded final state, and — what matters — the held-out τ of a draft trained on decoded
records over one trained on the raw ones (same data, same order, same steps, same raw test set),
once per seed: a ratio is the median of the per-seed ratios, reported with their range.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tide.bootstrap import BootstrapConfig, collect, train
from tide.infra.kafka.broker import KafkaBroker
from tide.models.loader import Target, load_target
from tide.producers.assembler import join
from tide.producers.publisher import PublisherConfig, RecordPublisher
from tide.producers.records import CODECS, HiddenStateRecord, decode, encode
from tide.prompts import Prompt, load_prompts, split
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams
from tide.trainers.ttt import Example, TrainConfig, Trainer

CHUNK = 128


@dataclass
class RecordsBenchConfig:
    prompts: Path
    limit: int = 32
    max_new_tokens: int = 128
    codecs: tuple[str, ...] = CODECS
    train_steps: int = 200
    seeds: tuple[int, ...] = (0,)  # each trains a raw draft and one per codec; ratios are per seed
    overhead_rounds: int = 4  # each runs every codec's capture and no capture once
    model: str | None = None
    weights: str = "auto"  # the serving target's linears (`tide.models.weights`)


def as_records(ex: Example, fingerprint: str, size: int = CHUNK) -> list[HiddenStateRecord]:
    """An example cut into records as the publisher cuts a request, `size` positions each (the last
    token is not kept); positions up to `learn_from` are the prompt's, as `example_of` reads them."""
    n = len(ex.aux)
    tokens = torch.cat([ex.tokens, ex.tokens[-1:]])
    return [
        HiddenStateRecord(
            tokens=tokens[s : min(n, s + size) + 1],
            aux=ex.aux[s : s + size],
            hidden=ex.hidden[s : s + size],
            prefill=torch.arange(s, min(n, s + size)) <= ex.learn_from,
            target_fingerprint=fingerprint,
            draft_version="bench",
            workload="bench",
            request_id="r",
            chunk=i,
            first_position=s,
            last=s + size >= n,
        )
        for i, s in enumerate(range(0, n, size))
    ]


def _rel_errors(orig: Example, dec: Example, d: int) -> torch.Tensor:
    """Relative L2 error per token for each aux layer and the final state: (n, 4)."""
    a = torch.cat([orig.aux.float().reshape(len(orig.aux), 3, d), orig.hidden.float().unsqueeze(1)], 1)
    b = torch.cat([dec.aux.float().reshape(len(dec.aux), 3, d), dec.hidden.float().unsqueeze(1)], 1)
    return (a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-6)


def _kl(orig: torch.Tensor, dec: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """KL(target from original state || target from decoded state) per token."""
    out = []
    for a, b in zip(orig.split(256), dec.split(256), strict=True):
        la = torch.log_softmax(a.float() @ lm_head.T, -1)
        lb = torch.log_softmax(b.float() @ lm_head.T, -1)
        out.append((la.exp() * (la - lb)).sum(-1))
    return torch.cat(out)


def _held_out_tau(
    target: Target, train_set: list[Example], test_set: list[Example], steps: int, seed: int
) -> float:
    cfg = BootstrapConfig(
        budget_minutes=10**6, max_steps=steps, eval_every=10**9, train=TrainConfig(seed=seed)
    )
    draft, _ = train(target, train_set, cfg, time.monotonic() + 10**9, "bench")
    lm_head = target.model.lm_head.weight.detach().float()
    return Trainer(draft, lm_head, TrainConfig()).evaluate(test_set).tau[-1]


def _capture_overhead(target: Target, prompts: list[list[int]], cfg: RecordsBenchConfig) -> dict[str, Any]:
    """Engine tokens/s without capture and with capture publishing each codec to a real broker. One
    engine serves every mode (its tap swapped), every round runs each mode once, in an order rotated
    each round; a codec's overhead is the median over rounds of 1 - its tokens/s over the same
    round's without capture."""
    params = SamplingParams(max_tokens=cfg.max_new_tokens, ignore_eos=True)
    modes = ["off", *cfg.codecs]
    rates: dict[str, list[float]] = {m: [] for m in modes}
    engine = Engine(target, None, EngineConfig(max_batch=4, max_model_len=2048, gamma=0))
    with tempfile.TemporaryDirectory() as tmp, KafkaBroker(Path(tmp)) as broker:
        publishers = {
            c: RecordPublisher(PublisherConfig(broker.bootstrap, c), target.fingerprint) for c in cfg.codecs
        }
        rounds = cfg.overhead_rounds
        with tqdm(total=rounds * len(modes), desc="capture overhead", unit="run") as bar:
            for r in range(rounds):
                for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                    engine.tap = publishers.get(mode)  # "off": none
                    start = time.perf_counter()
                    seqs = engine.generate(prompts, params)
                    rates[mode].append(sum(len(s.output) for s in seqs) / (time.perf_counter() - start))
                    bar.update()
        for p in publishers.values():
            p.close()
    capture = {}
    for c in cfg.codecs:
        overheads = [1 - on / off for on, off in zip(rates[c], rates["off"], strict=True)]
        stats = publishers[c].stats
        capture[c] = {
            "tokens_per_s": statistics.median(rates[c]),
            "overhead": statistics.median(overheads),
            "overhead_range": [min(overheads), max(overheads)],
            "records_published": stats.records_published,
            "records_lost": stats.records_dropped + stats.records_failed,
        }
    return {"tokens_per_s_off": statistics.median(rates["off"]), "capture": capture}


def run_records_bench(cfg: RecordsBenchConfig) -> dict[str, Any]:
    target = load_target(cfg.model, weights=cfg.weights, compile=cfg.weights != "bf16")
    chosen: list[Prompt] = split(load_prompts(cfg.prompts), "all")[: cfg.limit]
    boot = BootstrapConfig(max_new_tokens=cfg.max_new_tokens)
    examples = collect(target, chosen, boot, time.monotonic() + 10**9)
    d = target.config.hidden_size
    lm_head = target.model.lm_head.weight.detach().float()
    positions = sum(len(e.aux) for e in examples)
    cut = max(1, len(examples) * 4 // 5)
    test_raw = examples[cut:]

    raw_bytes = sum(
        len(encode(r, "bf16", zstd=False)) for e in examples for r in as_records(e, target.fingerprint)
    )
    report: dict[str, Any] = {
        "weights": target.weights,
        "prompts": len(examples),
        "positions": positions,
        "raw_bf16_bytes_per_token": raw_bytes / positions,
        "train_steps": cfg.train_steps,
        "seeds": list(cfg.seeds),
        "codecs": {},
    }
    # train_steps 0: no drafts (bytes, error, KL and capture's cost only)
    seeds = cfg.seeds if cfg.train_steps else ()
    tau_raw = [_held_out_tau(target, examples[:cut], test_raw, cfg.train_steps, seed) for seed in seeds]
    report["tau_raw"] = statistics.median(tau_raw) if tau_raw else None
    report["tau_raw_by_seed"] = tau_raw
    for codec in tqdm(cfg.codecs, desc="codecs", unit="codec"):
        size, decoded, errors, kls = 0, [], [], []
        for ex in examples:
            parts = []
            for rec in as_records(ex, target.fingerprint):
                blob = encode(rec, codec)
                size += len(blob)
                parts.append(decode(blob, target.fingerprint))
            joined = join(parts)
            dec = Example.make(ex.tokens, joined.aux, joined.hidden, lm_head, ex.learn_from)
            decoded.append(dec)
            errors.append(_rel_errors(ex, dec, d).flatten())
            kls.append(_kl(ex.hidden, dec.hidden, lm_head))
        err = torch.cat(errors)
        lossless = all(
            torch.equal(a.aux, b.aux) and torch.equal(a.hidden, b.hidden)
            for a, b in zip(examples, decoded, strict=True)
        )
        # identical training data trains an identical draft: no need to spend the time again
        tau = tau_raw
        if not lossless:
            tau = [_held_out_tau(target, decoded[:cut], test_raw, cfg.train_steps, seed) for seed in seeds]
        ratios = [t / r for t, r in zip(tau, tau_raw, strict=True)]
        report["codecs"][codec] = {
            "bytes_per_token": size / positions,
            "compression_vs_raw_bf16": raw_bytes / size,
            "rel_error_median": float(err.median()),
            "rel_error_p95": float(err.quantile(0.95)),
            "target_kl": float(torch.cat(kls).mean()),
            "tau": statistics.median(tau) if tau else None,
            "tau_by_seed": tau,
            "draft_tau_ratio": statistics.median(ratios) if ratios else None,
            "draft_tau_ratio_range": [min(ratios), max(ratios)] if ratios else None,
            "lossless": lossless,
        }
    prompts = [p.token_ids(target.tok) for p in chosen[:8]]
    overhead = _capture_overhead(target, prompts, cfg)
    report["tokens_per_s_off"] = overhead["tokens_per_s_off"]
    for codec, row in overhead["capture"].items():
        report["codecs"][codec]["capture_overhead"] = row["overhead"]
        report["codecs"][codec]["capture_overhead_range"] = row["overhead_range"]
        report["codecs"][codec]["capture_records_lost"] = row["records_lost"]
    return report


def plot_records_report(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    codecs = list(report["codecs"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    values = [
        (
            [report["raw_bf16_bytes_per_token"]] + [report["codecs"][c]["bytes_per_token"] for c in codecs],
            "bytes per token",
        ),
        (
            [0.0] + [report["codecs"][c]["rel_error_p95"] for c in codecs],
            "relative error, p95 (token × layer)",
        ),
        (
            [1.0] + [report["codecs"][c]["draft_tau_ratio"] or float("nan") for c in codecs],
            "draft τ ratio (decoded / raw)",
        ),
    ]
    labels = ["raw bf16", *codecs]
    for ax, (ys, title) in zip(axes, values, strict=True):
        ax.bar(labels, ys, color=["#999999"] + ["#3b7dd8"] * len(codecs))
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=20)
    rows = [report["codecs"][c] for c in codecs]
    if not any(r["draft_tau_ratio"] for r in rows):  # --train-steps 0
        axes[2].clear()
        axes[2].set_title("draft τ ratio: no drafts trained")
        axes[2].axis("off")
    elif all(r["draft_tau_ratio_range"] for r in rows):  # the τ ratios' spread over seeds, zoomed in
        mid = [r["draft_tau_ratio"] for r in rows]
        low = [m - r["draft_tau_ratio_range"][0] for m, r in zip(mid, rows, strict=True)]
        high = [r["draft_tau_ratio_range"][1] - m for m, r in zip(mid, rows, strict=True)]
        axes[2].errorbar(codecs, mid, yerr=[low, high], fmt="none", ecolor="black", capsize=4)
        axes[2].set_ylim(min(0.9, *(r["draft_tau_ratio_range"][0] for r in rows)) - 0.02, 1.08)
    title = f"record codecs on {report['positions']} positions"
    # reports without a range timed each mode on its own engine: their overheads are not comparable
    if all("capture_overhead_range" in r for r in rows):
        overheads = ", ".join(f"{c} {r['capture_overhead']:.1%}" for c, r in zip(codecs, rows, strict=True))
        title += f"; capture overhead (median of rounds): {overheads}"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
