"""`tide bench spec`: the same prompts with speculation off and on, interleaved in one process.

Besides a fixed gamma, TIDE's controller serves them too (`adaptive`: it chooses gamma at every step,
0 where the draft does not pay): on prompts the draft does not fit, its ratio to no speculation is
what speculation that is off costs (its checks, the controller's own work). With `--proposer suffix`
or `hybrid`, that proposer runs at the fixed gamma and under the controller (`adaptive_proposer`).

Modes run group by group (a group = two batches' worth of prompts), in a rotating order, so a noisy
neighbour on a shared machine slows every mode alike. Speed is reported as tokens/s per mode and
as ratios; the cost model's prediction is computed from step times measured in the same process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tide.bench import cpu_description
from tide.config import native_dtype
from tide.models.eagle3 import Eagle3Draft
from tide.models.hf_folder import write_hf_folder
from tide.models.loader import Target, load_target
from tide.producers.tap import TapEvent
from tide.prompts import load_prompts, split
from tide.serving.controller import ControllerConfig
from tide.serving.cost_model import measure_profile
from tide.serving.drafts import DraftStats
from tide.serving.engine import Engine, EngineConfig, StepTiming
from tide.serving.node import NodeConfig, ServingNode
from tide.serving.sampling import SamplingParams
from tide.serving.suffix import SuffixProposer
from tide.serving.vllm_adapter.config import VllmConfig
from tide.serving.vllm_adapter.process import VllmProcess, VllmResult
from tide.trainers.export import export_speculators


@dataclass
class SpecBenchConfig:
    prompts: Path
    draft: Path
    max_new_tokens: int = 128
    batch_size: int = 1
    dtype: torch.dtype = field(default_factory=native_dtype)
    gamma: int = 4
    part: str = "test"
    limit: int = 16
    model: str | None = None
    llama_cpp: bool = True
    # "vllm": also vLLM without speculation and with the same draft (its CPU build, in its own virtualenv)
    engine: str = "tide"
    # suffix or hybrid: also an engine drafting from the prompts' recent text (beside the draft: hybrid)
    proposer: str = "draft"
    weights: str = "auto"  # the target's linears (`tide.models.weights`)
    compile: bool = True


@dataclass
class ModeResult:
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _noop_tap(ev: TapEvent) -> None:
    return None


def _top2_gap(target: Target, prefix: list[int]) -> float:
    """The reference's logit margin between its best and second-best token after `prefix`."""
    model = target.model
    with torch.inference_mode():
        top = model.logits(model.forward_once(torch.tensor([prefix])).hidden[:, -1]).topk(2, -1).values[0]
    return float(top[0] - top[1])


def open_llama_cpp(path: Path, n_ctx: int) -> Any | None:
    """llama.cpp on the same GGUF and threads, where llama-cpp-python is installed (`make` installs it)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(
        model_path=str(path), n_ctx=n_ctx, n_threads=torch.get_num_threads(), n_batch=512, verbose=False
    )


def _vllm_engines(
    cfg: SpecBenchConfig, target: Target, max_len: int, stack: contextlib.ExitStack
) -> dict[str, VllmProcess]:
    """vLLM without speculation and with the benchmark's draft, on the same threads as TIDE's engines."""
    folder, _ = write_hf_folder(cfg.model)
    work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tide-vllm-")))
    draft = export_speculators(
        cfg.draft, work / "draft", verifier_name_or_path=str(folder), speculative_tokens=cfg.gamma
    )
    common = VllmConfig(
        folder, None, cfg.gamma, str(cfg.dtype).replace("torch.", ""), max_len, cfg.batch_size,
        torch.get_num_threads(),
    )  # fmt: skip
    return {
        "vllm": stack.enter_context(VllmProcess(common)),
        "vllm_speculative": stack.enter_context(VllmProcess(dataclasses.replace(common, draft_dir=draft))),
    }


def _vllm_report(runs: list[VllmResult], result: ModeResult, gamma: int) -> dict[str, Any]:
    """A vLLM mode's figures, acceptance as TIDE's engine reports it: by depth, given the one before."""
    drafts = sum(r.drafts for r in runs)
    accepted = [
        sum(r.accepted_by_position[i] for r in runs if i < len(r.accepted_by_position)) for i in range(gamma)
    ]
    out: dict[str, Any] = {
        "tokens_per_s": result.tokens_per_s,
        "tokens": result.tokens,
        "seconds": result.seconds,
    }
    if drafts:
        out["mean_accept_length"] = 1.0 + sum(accepted) / drafts
        reached = [drafts, *accepted[:-1]]  # vLLM counts acceptance at each position over all drafts
        out["accept_rate_by_depth"] = [a / n if n else 0.0 for a, n in zip(accepted, reached, strict=True)]
        out["drafts"] = drafts
    return out


def run_spec_bench(cfg: SpecBenchConfig) -> dict[str, Any]:
    if cfg.engine not in ("tide", "vllm"):
        raise ValueError(f"unknown engine {cfg.engine!r}: tide or vllm")
    with contextlib.ExitStack() as stack:
        return _run(cfg, stack)


def _run(cfg: SpecBenchConfig, stack: contextlib.ExitStack) -> dict[str, Any]:
    target = load_target(cfg.model, cfg.dtype, weights=cfg.weights, compile=cfg.compile)
    tok = target.tok
    chosen = split(load_prompts(cfg.prompts), cfg.part)
    prompts = [p.token_ids(tok) for p in (chosen[: cfg.limit] if cfg.limit else chosen)]
    max_len = max(len(p) for p in prompts) + cfg.max_new_tokens + 8
    draft = Eagle3Draft.load(
        cfg.draft, target.model.embed_tokens, target.config, target.fingerprint, cfg.dtype
    )
    ecfg = EngineConfig(max_batch=cfg.batch_size, max_model_len=max_len, gamma=cfg.gamma)
    ccfg = ControllerConfig()
    served = EngineConfig(max_batch=cfg.batch_size, max_model_len=max_len, gamma=0, max_gamma=ccfg.max_gamma)

    def node(proposer: str) -> Engine:
        """What `tide serve --gamma auto --proposer ...` runs: the controller chooses gamma."""
        return ServingNode.build(
            target,
            draft,  # loaded with --gamma auto whatever the proposer, as `tide serve` does
            NodeConfig(
                dataclasses.replace(served, proposer=proposer),
                adaptive=ccfg,
                profile_batches=(1, cfg.batch_size),
            ),
        ).engine

    engines = {
        "baseline": Engine(
            target, None, EngineConfig(max_batch=cfg.batch_size, max_model_len=max_len, gamma=0)
        ),
        "speculative": Engine(target, draft, ecfg),
        "speculative_tap": Engine(target, draft, ecfg, tap=_noop_tap),
        "adaptive": node("draft"),
    }
    if cfg.proposer != "draft":
        engines["proposer"] = Engine(
            target,
            draft if cfg.proposer == "hybrid" else None,
            dataclasses.replace(ecfg, proposer=cfg.proposer),
        )
        engines["adaptive_proposer"] = node(cfg.proposer)
    llama = open_llama_cpp(target.path, max_len) if cfg.llama_cpp and target.path.suffix == ".gguf" else None
    vllm = _vllm_engines(cfg, target, max_len, stack) if cfg.engine == "vllm" else {}
    vllm_runs: dict[str, list[VllmResult]] = {name: [] for name in vllm}
    params = SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens, ignore_eos=False)
    # a group holds two batches' worth of prompts: continuous batching refills slots as requests
    # finish, as in serving, instead of timing a closed batch draining to its longest sequence
    size = 2 * cfg.batch_size
    groups = [prompts[i : i + size] for i in range(0, len(prompts), size)]

    # warm-up (allocations, oneDNN kernel selection), not timed; a suffix index starts empty
    for eng in engines.values():
        eng.generate(groups[0][:1], SamplingParams(max_tokens=8))
        if eng.suffix is not None:
            eng.suffix = SuffixProposer(eng.cfg.suffix)
    for eng in engines.values():
        eng.stats = DraftStats(eng.cfg.max_gamma)
        eng.tap_seconds = 0.0
        eng.timing = StepTiming()

    results = {name: ModeResult() for name in engines}
    if llama is not None:
        results["llama_cpp"] = ModeResult()
    for name, proc in vllm.items():
        proc.generate(groups[0][:1], 8)  # warm-up, not timed
        results[name] = ModeResult()
    outputs: dict[str, list[list[int]]] = {name: [] for name in [*engines, *vllm]}
    decoded = dict.fromkeys(engines, 0)  # sequence-steps after prefill, drafted or not
    group_speedups: list[float] = []
    adaptive_speedups: list[float] = []
    proposer_ratios: list[float] = []  # per group: the proposer's engine over the draft alone
    adaptive_proposer_speedups: list[float] = []
    modes = list(results)
    for gi, group in enumerate(tqdm(groups, desc="bench spec", unit="batch")):
        per_group: dict[str, ModeResult] = {}
        order = modes[gi % len(modes) :] + modes[: gi % len(modes)]
        for name in order:
            start = time.perf_counter()
            if name == "llama_cpp" and llama is not None:
                n = 0
                for p in group:
                    llama.reset()  # no reuse of the previous prompt's chat template: TIDE prefills it all
                    res = llama.create_completion(prompt=p, max_tokens=cfg.max_new_tokens, temperature=0.0)
                    n += int(res["usage"]["completion_tokens"])
                per_group[name] = ModeResult(n, time.perf_counter() - start)
            elif name in vllm:
                run = vllm[name].generate(group, cfg.max_new_tokens)
                per_group[name] = ModeResult(run.tokens, time.perf_counter() - start)
                outputs[name] += run.outputs
                vllm_runs[name].append(run)
            else:
                seqs = engines[name].generate(group, params)
                per_group[name] = ModeResult(sum(len(s.output) for s in seqs), time.perf_counter() - start)
                outputs[name] += [s.output for s in seqs]
                decoded[name] += sum(s.steps for s in seqs)
            results[name].tokens += per_group[name].tokens
            results[name].seconds += per_group[name].seconds
        group_speedups.append(per_group["speculative"].tokens_per_s / per_group["baseline"].tokens_per_s)
        if "proposer" in per_group:
            proposer_ratios.append(per_group["proposer"].tokens_per_s / per_group["speculative"].tokens_per_s)
            adaptive_proposer_speedups.append(
                per_group["adaptive_proposer"].tokens_per_s / per_group["baseline"].tokens_per_s
            )
        adaptive_speedups.append(per_group["adaptive"].tokens_per_s / per_group["baseline"].tokens_per_s)

    matches, gaps = _greedy_agreement(target, prompts, outputs["baseline"], outputs["speculative"])

    spec = engines["speculative"]
    alphas = spec.stats.rates()[: cfg.gamma]
    context = int(statistics.median(len(p) for p in prompts)) + cfg.max_new_tokens // 2
    profile = measure_profile(target.model, spec.draft, cfg.batch_size, context, cfg.gamma + 1)
    isolated = profile.speedup(alphas, cfg.gamma)
    # the same model with what the engines measured while serving: per-step bookkeeping and the real
    # cost of drafting gamma tokens (catch-up + chain), which isolated draft steps underestimate
    profile.overhead = max(0.0, engines["baseline"].timing.step - profile.target[1])
    profile.draft_total = spec.timing.propose
    base_tps = results["baseline"].tokens_per_s
    tapped = engines["speculative_tap"]
    adaptive = engines["adaptive"]
    report: dict[str, Any] = {
        "cpu": cpu_description(),
        "dtype": str(cfg.dtype).replace("torch.", ""),
        "weights": target.weights,
        "compiled": target.compiled,
        "batch_size": cfg.batch_size,
        "gamma": cfg.gamma,
        "prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "threads": torch.get_num_threads(),
        "draft_version": draft.cfg.version,
        "baseline": {
            "tokens_per_s": base_tps,
            "tokens": results["baseline"].tokens,
            "seconds": results["baseline"].seconds,
        },
        "speculative": {
            "tokens_per_s": results["speculative"].tokens_per_s,
            "tokens": results["speculative"].tokens,
            "seconds": results["speculative"].seconds,
            "mean_accept_length": spec.stats.mean_accept_length,
            "accept_rate_by_depth": alphas,
        },
        "speedup": results["speculative"].tokens_per_s / base_tps,
        "speedup_median_over_groups": statistics.median(group_speedups),
        "adaptive": {
            "tokens_per_s": results["adaptive"].tokens_per_s,
            "tokens": results["adaptive"].tokens,
            "seconds": results["adaptive"].seconds,
            # sequence-steps that drafted (the controller's choice, or a check while it is off)
            "drafted_share": adaptive.stats.steps / decoded["adaptive"] if decoded["adaptive"] else 0.0,
            "mean_accept_length": adaptive.stats.mean_accept_length,
            "accept_rate_by_depth": adaptive.stats.rates(),
            "engine_step_s": adaptive.timing.step,
        },
        "adaptive_speedup": results["adaptive"].tokens_per_s / base_tps,
        "adaptive_speedup_median_over_groups": statistics.median(adaptive_speedups),
        "predicted_speedup": profile.speedup(alphas, cfg.gamma),
        "predicted_speedup_isolated": isolated,
        "step_profile": {
            "target_step_s": profile.target,
            "draft_step_s": profile.draft_step,
            "draft_total_s": profile.draft_total,
            "engine_overhead_s": profile.overhead,
            # whole decode steps as the engines ran them (mean over the run)
            "baseline_engine_step_s": engines["baseline"].timing.step,
            "speculative_engine_step_s": spec.timing.step,
            "baseline_engine_steps": engines["baseline"].timing.decode_steps,
            "speculative_engine_steps": spec.timing.decode_steps,
            "context": context,
        },
        "greedy_match_rate": sum(matches) / len(matches),
        "greedy_identical": all(matches),
        "divergence_top2_logit_gaps": gaps,
        # time spent handing hidden states to a no-op callback, over the tapped run's time
        "tap_overhead": tapped.tap_seconds / results["speculative_tap"].seconds,
        "tap_throughput_ratio": results["speculative_tap"].tokens_per_s / results["speculative"].tokens_per_s,
    }
    if "proposer" in engines:
        report["proposer"] = _proposer_report(cfg.proposer, engines["proposer"], results["proposer"],
                                              decoded["proposer"])  # fmt: skip
        report["proposer_speedup"] = results["proposer"].tokens_per_s / base_tps
        report["proposer_over_draft"] = results["proposer"].tokens_per_s / results["speculative"].tokens_per_s
        report["proposer_over_draft_by_group"] = proposer_ratios
        same, _ = _greedy_agreement(target, prompts, outputs["baseline"], outputs["proposer"])
        report["proposer_greedy_match_rate"] = sum(same) / len(same)
        report["adaptive_proposer"] = _proposer_report(
            cfg.proposer,
            engines["adaptive_proposer"],
            results["adaptive_proposer"],
            decoded["adaptive_proposer"],
        )
        report["adaptive_proposer_speedup"] = results["adaptive_proposer"].tokens_per_s / base_tps
        report["adaptive_proposer_speedup_by_group"] = adaptive_proposer_speedups
        same, _ = _greedy_agreement(target, prompts, outputs["baseline"], outputs["adaptive_proposer"])
        report["adaptive_proposer_greedy_match_rate"] = sum(same) / len(same)
    if llama is not None:
        report["llama_cpp"] = {
            "tokens_per_s": results["llama_cpp"].tokens_per_s,
            "tokens": results["llama_cpp"].tokens,
        }
    if vllm:
        for name in vllm:
            report[name] = _vllm_report(vllm_runs[name], results[name], cfg.gamma)
        report["vllm_speedup"] = results["vllm_speculative"].tokens_per_s / results["vllm"].tokens_per_s
        same, vgaps = _greedy_agreement(target, prompts, outputs["vllm"], outputs["vllm_speculative"])
        report["vllm_greedy_match_rate"] = sum(same) / len(same)
        report["vllm_divergence_top2_logit_gaps"] = vgaps
        # vLLM's kernels are not TIDE's: where they part, the reference's margin says it was a near tie
        same, vgaps = _greedy_agreement(target, prompts, outputs["baseline"], outputs["vllm"])
        report["vllm_vs_tide_greedy_match_rate"] = sum(same) / len(same)
        report["vllm_vs_tide_top2_logit_gaps"] = vgaps
    return report


def _proposer_report(name: str, engine: Engine, result: ModeResult, decoded: int) -> dict[str, Any]:
    """What the suffix index proposed and what was accepted of it, beside the draft's share."""
    assert engine.suffix is not None
    stats = list(engine.suffix.stats.values())
    chosen = engine.suffix.chosen
    proposed, accepted = sum(s.proposed_tokens for s in stats), sum(s.accepted_tokens for s in stats)
    return {
        "name": name,
        "tokens_per_s": result.tokens_per_s,
        "tokens": result.tokens,
        "seconds": result.seconds,
        "suffix_share": chosen / decoded if decoded else 0.0,  # sequence-steps drafted from the index
        "suffix_proposed_tokens": proposed,
        "suffix_accepted_tokens": accepted,
        "suffix_accept_rate": accepted / proposed if proposed else 0.0,
        "draft_share": engine.stats.steps / decoded if decoded else 0.0,
        "draft_mean_accept_length": engine.stats.mean_accept_length,
        "engine_step_s": engine.timing.step,
    }


def _greedy_agreement(
    target: Target, prompts: list[list[int]], ref: list[list[int]], other: list[list[int]]
) -> tuple[list[bool], list[float]]:
    """Which completions are identical, and the reference's top-2 logit gap where each first differs."""
    matches = [a == b for a, b in zip(ref, other, strict=True)]
    gaps = []
    for prompt, a, b, same in zip(prompts, ref, other, matches, strict=True):
        if not same:
            j = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            gaps.append(_top2_gap(target, prompt + a[:j]))
    return matches, gaps


def plot_spec_report(report: dict[str, Any], path: Path) -> None:
    """Throughput per system and acceptance by draft depth, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    proposer = report.get("proposer", {}).get("name", "")
    systems = [  # report key, label, colour
        ("baseline", "no spec.", "#888"),
        ("speculative", f"γ {report['gamma']}", "#2a7"),
        ("adaptive", "adaptive", "#a72"),
        ("proposer", f"{proposer} γ {report['gamma']}", "#c5a"),
        ("adaptive_proposer", f"adaptive {proposer}", "#e8c"),
        ("llama_cpp", "llama.cpp", "#47a"),
        ("vllm", "vLLM", "#bbb"),
        ("vllm_speculative", f"vLLM γ {report['gamma']}", "#7c9"),
    ]
    shown = [(label, report[key]["tokens_per_s"], colour) for key, label, colour in systems if key in report]
    bars = ax1.bar([x[0] for x in shown], [x[1] for x in shown], color=[x[2] for x in shown])
    ax1.bar_label(bars, fmt="%.1f")
    ax1.tick_params(axis="x", labelsize=8, labelrotation=20)
    ax1.set_ylabel("tokens/s")
    served = (
        f", adaptive {proposer} {report['adaptive_proposer_speedup']:.2f}x"
        if "adaptive_proposer_speedup" in report  # not in reports from before it ran under the controller
        else ""
    )
    ax1.set_title(
        f"batch {report['batch_size']}, {report.get('weights', report['dtype'])}: {report['speedup']:.2f}x, "
        f"adaptive {report['adaptive_speedup']:.2f}x{served}",
        fontsize=10,
    )
    engines = [("TIDE", report["speculative"], "#2a7")]
    if "accept_rate_by_depth" in report.get("vllm_speculative", {}):
        engines.append(("vLLM", report["vllm_speculative"], "#7c9"))
    width = 0.8 / len(engines)
    for k, (label, r, colour) in enumerate(engines):
        rates = r["accept_rate_by_depth"]
        xs = [i + 1 + (k - (len(engines) - 1) / 2) * width for i in range(len(rates))]
        ax2.bar(xs, rates, width, color=colour, label=f"{label}: {r['mean_accept_length']:.2f} tokens/step")
    ax2.set_xticks(range(1, len(report["speculative"]["accept_rate_by_depth"]) + 1))
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("draft depth")
    ax2.set_ylabel("acceptance rate (given the one before)")
    ax2.legend(loc="upper right", fontsize=8)
    ax2.set_title("one draft, acceptance by depth")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
