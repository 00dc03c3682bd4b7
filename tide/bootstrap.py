"""Bootstrap draft: the target answers prompts, the tap records hidden states, an EAGLE-3 head learns them.

This is `tide draft train`, and the "static draft" every later benchmark compares against.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict

import torch
from tqdm import tqdm

from tide.models.eagle3 import DraftConfig, Eagle3Draft
from tide.models.loader import Target
from tide.producers.tap import TapEvent
from tide.prompts import Prompt
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams
from tide.trainers.checkpoint import load_examples, save_examples
from tide.trainers.ttt import Example, Metrics, TrainConfig, Trainer, init_draft_head, select_vocab


@dataclass
class BootstrapConfig:
    budget_minutes: float = 10.0
    max_steps: int = 0  # stop training after this many steps (0: when the budget is spent)
    max_new_tokens: int = 256
    draft_vocab_size: int = 4096
    gen_batch: int = 16
    gen_fraction: float = 0.45  # at most this share of the budget goes to generating data
    eval_fraction: float = 0.1
    eval_every: int = 200
    temperature: float = 0.0
    train: TrainConfig | None = None


class Recorder:
    """Tap callback that assembles each request's hidden states into one training example."""

    def __init__(self) -> None:
        self.parts: dict[str, list[TapEvent]] = {}

    def __call__(self, ev: TapEvent) -> None:
        # the engine reuses its buffers: keep copies
        self.parts.setdefault(ev.request_id, []).append(
            TapEvent(
                ev.request_id,
                ev.workload,
                ev.first_position,
                ev.tokens.clone(),
                ev.aux.to(torch.bfloat16, copy=True),
                ev.hidden.to(torch.bfloat16, copy=True),
                ev.prefill,
                ev.draft_version,
                ev.final,
            )
        )

    def example(self, request_id: str, lm_head: torch.Tensor) -> Example:
        parts = sorted(self.parts.pop(request_id), key=lambda e: e.first_position)
        prompt_len = len(parts[0].tokens) - 1
        return Example.make(
            torch.cat([p.tokens[:-1] for p in parts]),  # the token each state comes with
            torch.cat([p.aux for p in parts]),
            torch.cat([p.hidden for p in parts]),
            lm_head,
            learn_from=prompt_len - 1,
        )


def collect(target: Target, prompts: list[Prompt], cfg: BootstrapConfig, deadline: float) -> list[Example]:
    """Serve the prompts (no speculation) and keep every request's hidden states."""
    rec = Recorder()
    engine = Engine(target, None, EngineConfig(max_batch=cfg.gen_batch, max_model_len=2048, gamma=0), tap=rec)
    params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens, seed=None)
    lm_head = target.model.lm_head.weight
    examples: list[Example] = []
    pending = list(prompts)
    with tqdm(total=len(prompts), desc="target answers prompts", unit="prompt") as bar:
        while pending or engine.has_work:
            # admit only what one batch runs: at the deadline at most a batch is left to finish,
            # and the training's share of the budget stays its own
            while (
                pending
                and len(engine.running) + len(engine.waiting) < cfg.gen_batch
                and time.monotonic() < deadline
            ):
                ids = pending.pop(0).token_ids(target.tok)
                engine.add(ids[-(2048 - cfg.max_new_tokens) :], params)
            if not engine.has_work:
                break
            for out in engine.step():
                if out.seq.finished:
                    examples.append(rec.example(out.seq.request_id, lm_head))
                    bar.update()
    return examples


def train(
    target: Target,
    examples: list[Example],
    cfg: BootstrapConfig,
    deadline: float,
    version: str,
) -> tuple[Eagle3Draft, list[dict[str, object]]]:
    tcfg = cfg.train or TrainConfig()
    random.seed(tcfg.seed)
    torch.manual_seed(tcfg.seed)
    shuffled = examples[:]
    random.shuffle(shuffled)
    n_eval = max(1, int(len(shuffled) * cfg.eval_fraction))
    held, train_set = shuffled[:n_eval], shuffled[n_eval:] or shuffled
    embed = torch.nn.Embedding.from_pretrained(target.model.embed_tokens.weight.detach().float(), freeze=True)
    dcfg = DraftConfig.for_target(target.config, target.fingerprint, cfg.draft_vocab_size)
    dcfg.version = version
    draft = Eagle3Draft(dcfg, embed)
    draft.set_vocab(select_vocab(train_set, dcfg.draft_vocab_size, dcfg.target_vocab_size))
    lm_head = target.model.lm_head.weight.detach().float()
    init_draft_head(draft, lm_head)
    trainer = Trainer(draft, lm_head, tcfg)
    history: list[dict[str, object]] = []
    best: tuple[float, dict[str, torch.Tensor]] | None = None

    def checkpoint() -> None:
        nonlocal best
        m: Metrics = trainer.evaluate(held)
        history.append({"step": trainer.steps, "eval_loss": m.loss, "top1": m.top1, "tau": m.tau})
        if best is None or m.tau[-1] > best[0]:
            best = (m.tau[-1], {k: v.clone() for k, v in draft.state_dict().items()})

    # the bar counts steps when their number is fixed, seconds of the budget otherwise
    by_steps = cfg.max_steps > 0
    total = cfg.max_steps if by_steps else round(max(1.0, deadline - time.monotonic()))
    with tqdm(total=total, desc="training draft", unit="step" if by_steps else "s") as bar:
        start = time.monotonic()
        while time.monotonic() < deadline and not (by_steps and trainer.steps >= cfg.max_steps):
            loss = trainer.step(random.sample(train_set, min(tcfg.batch_size, len(train_set))))
            bar.set_postfix(loss=f"{loss:.3f}", step=trainer.steps)
            bar.n = min(trainer.steps if by_steps else round(time.monotonic() - start), bar.total)
            bar.refresh()
            if trainer.steps % cfg.eval_every == 0:
                checkpoint()
        checkpoint()
    assert best is not None
    draft.load_state_dict(best[1])
    return draft.eval(), history


class BootstrapReport(TypedDict):
    """What `tide draft train` did (also written to the draft folder's training.json)."""

    version: str
    examples: int
    tokens: int
    seconds: float
    config: dict[str, object]
    history: list[dict[str, object]]


def bootstrap(
    target: Target, prompts: list[Prompt], out: Path, cfg: BootstrapConfig, data: Path | None = None
) -> BootstrapReport:
    """Collect (or reuse the hidden states saved at `data`), train within the budget, save the draft."""
    saved = data if data is not None and data.exists() else None
    if saved is None and not target.compiled:
        target.compile()  # the target answers the prompts (quantized modes): compiled outside the budget
    start = time.monotonic()
    budget = cfg.budget_minutes * 60
    if saved is not None:
        examples = load_examples(saved)
    else:
        examples = collect(target, prompts, cfg, start + budget * cfg.gen_fraction)
        if data is not None:
            save_examples(examples, data)
    if not examples:
        raise RuntimeError("no training data was collected: budget too small?")
    tokens = sum(len(e.tokens) for e in examples)
    version = f"bootstrap-{time.strftime('%Y%m%d-%H%M%S')}"
    draft, history = train(target, examples, cfg, start + budget, version)
    draft.save(out)
    report: BootstrapReport = {
        "version": version,
        "examples": len(examples),
        "tokens": tokens,
        "seconds": time.monotonic() - start,
        "config": asdict(cfg),
        "history": history,
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
