"""Device check (not part of the test suite): the trainer's step on CUDA matches the CPU and how fast it is.

Run on a machine with a GPU: `python scripts/cuda_trainer_check.py`. It builds a draft shaped like the
default model's (d=576, 49,152-token vocabulary, 4,096-token draft vocabulary), feeds both devices the
same random examples from the same initial weights, and prints the losses side by side and the
positions trained per second on each.
"""

from __future__ import annotations

import json
import time

import torch

from tide.models.eagle3 import DraftConfig, Eagle3Draft
from tide.models.llama import LlamaConfig
from tide.trainers.ttt import Example, TrainConfig, Trainer


def make(device: str, lm_head: torch.Tensor, embed: torch.Tensor, cfg: LlamaConfig) -> Trainer:
    torch.manual_seed(0)
    dcfg = DraftConfig.for_target(cfg, "check", 4096)
    draft = Eagle3Draft(dcfg, torch.nn.Embedding.from_pretrained(embed.to(device), freeze=True))
    draft.set_vocab(torch.arange(0, 49152, 12))
    return Trainer(draft.to(device), lm_head.to(device), TrainConfig(autocast=True, batch_size=8, seed=0))


def main() -> None:
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(49152, 576, generator=g) * 0.02
    lm_head = torch.randn(49152, 576, generator=g) * 0.02
    examples = []
    for _ in range(64):
        n = 256
        hidden = torch.randn(n, 576, generator=g)
        ex = Example.make(torch.randint(0, 49152, (n,), generator=g), torch.randn(n, 3 * 576, generator=g) * 3,
                          hidden, lm_head, 0)  # fmt: skip
        examples.append(ex)
    report: dict[str, object] = {"cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    losses: dict[str, list[float]] = {}
    for device in ("cpu", "cuda"):
        trainer = make(device, lm_head, embed, cfg)
        steps = 20 if device == "cpu" else 200
        trainer.step(examples[:8])  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = []
        for i in range(steps):
            out.append(trainer.step([examples[(i * 8 + j) % 64] for j in range(8)]))
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        losses[device] = out[:20]
        report[f"{device}_positions_per_s"] = steps * 8 * 256 / seconds
        report[f"{device}_tau"] = trainer.evaluate(examples[:16]).tau
    report["loss_cpu_first20"] = [round(x, 4) for x in losses["cpu"]]
    report["loss_cuda_first20"] = [round(x, 4) for x in losses["cuda"]]
    diffs = [abs(a - b) / max(abs(a), 1e-6) for a, b in zip(losses["cpu"], losses["cuda"], strict=True)]
    report["max_rel_loss_diff_first20"] = max(diffs)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
