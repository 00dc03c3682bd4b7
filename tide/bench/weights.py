"""`tide bench weights`: each weight mode's quality against the fp32 model, and its speed beside llama.cpp.

Quality: the fp32 model (dense weights as the file stores them, dequantized) answers each shipped
workload's held-out prompts greedily; every mode then reads prompt + answer in one pass, and at
each answer position its top-1 token is compared with fp32's and KL(fp32 || mode) is taken.

Speed, no speculation, batch 1: decode tokens/s on held-out code prompts, and time to first token
on prompts of exactly `ttft_tokens` tokens, each mode and llama.cpp (same GGUF, same threads) in
rotating order round after round, so a noisy neighbour slows them alike. llama.cpp's context is
reset before each prompt: it would otherwise reuse the chat template's tokens from the one before.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tide.bench import cpu_description
from tide.bench.spec import open_llama_cpp
from tide.config import native_dtype
from tide.models.loader import Target, load_target
from tide.prompts import WORKLOADS, load_prompts, split
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams


@dataclass
class WeightsBenchConfig:
    modes: tuple[str, ...] = ("bf16", "int8", "int4", "gguf")
    workloads: tuple[Path, ...] = field(
        default_factory=lambda: tuple(
            WORKLOADS / f"{w}.jsonl" for w in ("code", "chat_en", "math", "chat_fr")
        )
    )
    quality_prompts: int = 8  # held-out prompts per workload
    answer_tokens: int = 64  # fp32's greedy answer, read by every mode
    speed_prompts: int = 4  # held-out code prompts per round
    max_new_tokens: int = 128
    ttft_tokens: int = 250
    rounds: int = 3
    dtype: torch.dtype = field(default_factory=native_dtype)
    compile: bool = True
    llama_cpp: bool = True
    model: str | None = None


def _quality(reference: Target, targets: dict[str, Target], cfg: WeightsBenchConfig) -> dict[str, Any]:
    """Per mode and workload: top-1 agreement with fp32 and mean KL over fp32's answer positions."""
    out: dict[str, Any] = {mode: {} for mode in targets}
    engine = Engine(reference, None, EngineConfig(max_batch=8, max_model_len=1024, gamma=0))
    for path in tqdm(cfg.workloads, desc="quality", unit="workload"):
        prompts = [
            p.token_ids(reference.tok) for p in split(load_prompts(path), "test")[: cfg.quality_prompts]
        ]
        answers = engine.generate(prompts, SamplingParams(max_tokens=cfg.answer_tokens))
        sums = {mode: [0, 0.0, 0] for mode in targets}  # agreeing positions, KL sum, positions
        for prompt, seq in zip(prompts, answers, strict=True):
            ids = torch.tensor([prompt + seq.output])
            span = slice(len(prompt) - 1, ids.shape[1] - 1)  # positions that predict the answer
            with torch.inference_mode():
                ref = reference.model.logits(reference.model.forward_once(ids).hidden[:, span])[0]
                ref_lp = ref.log_softmax(-1)
                for mode, t in targets.items():
                    lp = t.model.logits(t.model.forward_once(ids).hidden[:, span])[0].log_softmax(-1)
                    s = sums[mode]
                    s[0] += int((lp.argmax(-1) == ref.argmax(-1)).sum())
                    s[1] += float((ref_lp.exp() * (ref_lp - lp)).sum())
                    s[2] += lp.shape[0]
        for mode, (agree, kl, n) in sums.items():
            out[mode][path.stem] = {"top1_agreement": agree / n, "mean_kl": kl / n, "positions": n}
    for mode in targets:
        per = out[mode].values()
        n = sum(w["positions"] for w in per)
        out[mode]["all"] = {
            "top1_agreement": sum(w["top1_agreement"] * w["positions"] for w in per) / n,
            "mean_kl": sum(w["mean_kl"] * w["positions"] for w in per) / n,
            "positions": n,
        }
    return out


def _ttft_prompts(target: Target, n: int, length: int) -> list[list[int]]:
    """Prompts of exactly `length` tokens: held-out code prompts, each run on with the next ones."""
    pool = [p.token_ids(target.tok) for p in split(load_prompts(WORKLOADS / "code.jsonl"), "test")]
    out = []
    for i in range(n):
        ids: list[int] = []
        j = i
        while len(ids) < length:
            ids += pool[j % len(pool)]
            j += 1
        out.append(ids[:length])
    return out


def run_weights_bench(cfg: WeightsBenchConfig) -> dict[str, Any]:
    reference = load_target(cfg.model, torch.float32, weights="bf16", pack=False)
    targets = {m: load_target(cfg.model, cfg.dtype, weights=m, compile=cfg.compile) for m in cfg.modes}
    quality = _quality(reference, targets, cfg)
    del reference

    first = next(iter(targets.values()))
    code = split(load_prompts(WORKLOADS / "code.jsonl"), "test")
    n = cfg.speed_prompts * cfg.rounds
    prompts = [p.token_ids(first.tok) for p in (code * (n // len(code) + 1))[:n]]
    long = _ttft_prompts(first, cfg.rounds * 2, cfg.ttft_tokens)
    max_len = max(len(p) for p in prompts + long) + cfg.max_new_tokens + 8
    engines = {
        m: Engine(t, None, EngineConfig(max_batch=1, max_model_len=max_len, gamma=0))
        for m, t in targets.items()
    }
    llama = open_llama_cpp(first.path, max_len) if cfg.llama_cpp and first.path.suffix == ".gguf" else None
    names = [*engines, *(["llama_cpp"] if llama is not None else [])]
    greedy = SamplingParams(max_tokens=cfg.max_new_tokens)
    for eng in engines.values():  # warm-up: allocations, kernel choices, compiled shapes
        eng.generate([prompts[0], long[0]], SamplingParams(max_tokens=8))
    if llama is not None:
        llama.create_completion(prompt=prompts[0], max_tokens=8, temperature=0.0)

    tps: dict[str, list[float]] = {m: [] for m in names}
    ttft: dict[str, list[float]] = {m: [] for m in names}
    for r in tqdm(range(cfg.rounds), desc="speed", unit="round"):
        batch = prompts[r * cfg.speed_prompts : (r + 1) * cfg.speed_prompts]
        pair = long[2 * r : 2 * r + 2]
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name == "llama_cpp":
                assert llama is not None
                tokens, start = 0, time.perf_counter()
                for p in batch:
                    llama.reset()
                    res = llama.create_completion(prompt=p, max_tokens=cfg.max_new_tokens, temperature=0.0)
                    tokens += int(res["usage"]["completion_tokens"])
                tps[name].append(tokens / (time.perf_counter() - start))
                for p in pair:
                    llama.reset()
                    start = time.perf_counter()
                    llama.create_completion(prompt=p, max_tokens=1, temperature=0.0)
                    ttft[name].append(time.perf_counter() - start)
                continue
            eng = engines[name]
            start = time.perf_counter()
            seqs = eng.generate(batch, greedy)
            tps[name].append(sum(len(s.output) for s in seqs) / (time.perf_counter() - start))
            for p in pair:
                eng.add(p, SamplingParams(max_tokens=1))
                start = time.perf_counter()
                eng.step()  # the prefill step yields the first token
                ttft[name].append(time.perf_counter() - start)
    speed: dict[str, dict[str, Any]] = {
        m: {
            "tokens_per_s": statistics.median(tps[m]),
            "tokens_per_s_by_round": tps[m],
            "ttft_s": statistics.median(ttft[m]),
            "ttft_s_all": ttft[m],
        }
        for m in names
    }
    if llama is not None:
        ref_tps, ref_ttft = speed["llama_cpp"]["tokens_per_s"], speed["llama_cpp"]["ttft_s"]
        for m in engines:
            speed[m]["over_llama_cpp"] = speed[m]["tokens_per_s"] / ref_tps
            speed[m]["ttft_over_llama_cpp"] = speed[m]["ttft_s"] / ref_ttft
    return {
        "cpu": cpu_description(),
        "threads": torch.get_num_threads(),
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "compiled": {m: t.compiled for m, t in targets.items()},
        "answer_tokens": cfg.answer_tokens,
        "ttft_tokens": cfg.ttft_tokens,
        "max_new_tokens": cfg.max_new_tokens,
        "rounds": cfg.rounds,
        "quality": quality,
        "speed": speed,
    }


def plot_weights_report(report: dict[str, Any], path: Path) -> None:
    """Decode tokens/s and time to first token per mode (llama.cpp beside), and quality per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed, quality = report["speed"], report["quality"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4.2))
    names = list(speed)
    colours = ["#47a" if n == "llama_cpp" else "#2a7" for n in names]
    for ax, key, scale, label in ((ax1, "tokens_per_s", 1.0, "tokens/s (batch 1)"),
                                  (ax2, "ttft_s", 1e3, f"ms to first token ({report['ttft_tokens']}-token prompts)")):  # fmt: skip
        values = [speed[n][key] * scale for n in names]
        bars = ax.bar(names, values, color=colours)
        ax.bar_label(bars, fmt="%.1f")
        ax.set_ylabel(label)
    ax1.set_title(f"no speculation, {report['threads']} threads, median of {report['rounds']} rounds")
    modes = list(quality)
    agree = [quality[m]["all"]["top1_agreement"] for m in modes]
    kl = [quality[m]["all"]["mean_kl"] for m in modes]
    bars = ax3.bar(modes, agree, color="#2a7")
    ax3.bar_label(bars, labels=[f"{a:.3f}\nKL {k:.4f}" for a, k in zip(agree, kl, strict=True)], fontsize=8)
    ax3.set_ylim(min(agree) - 0.05, 1.0)
    ax3.set_ylabel("top-1 agreement with fp32")
    ax3.set_title("quality, held-out prompts of 4 workloads")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
