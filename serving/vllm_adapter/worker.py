"""What TIDE adds to vLLM's worker: the tap and live draft swaps.

`TideWorker` is mixed into vLLM's worker through its public `worker_extension_cls` option; vLLM
calls its methods through `collective_rpc`, which its engine runs between two steps. The draft swap
reads a folder in vLLM's speculators format (`trainers.export.export_speculators`) into the drafter
vLLM built at start (`model_runner.drafter.model`, the second vLLM internal this adapter relies
on) with vLLM's in-place reload (`model_loader.reload`: the drafter's own `load_weights`, then its
kernels' weights packed again). The new draft must have the names and shapes of the one serving,
checked before anything is touched, so a refused draft never leaves a mixture serving. Requests in flight keep the draft KV entries the old draft wrote; their
next drafts are worse for a few tokens, never wrong (verification decides what is kept).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tide.serving.vllm_adapter.config import TapConfig


class TideWorker:
    model_runner: Any

    def tide_attach_tap(self, config: str) -> None:
        from tide.producers.publisher import PublisherConfig, RecordPublisher
        from tide.serving.capture import CapturePolicy, WorkloadSet, parse_rules
        from tide.serving.vllm_adapter.tap import VllmTap

        c = TapConfig(**json.loads(config))
        publisher = RecordPublisher(PublisherConfig(c.bootstrap, c.codec, c.chunk_positions), c.fingerprint)
        names = [w.strip() for w in c.workloads.split(",") if w.strip()]
        policy = CapturePolicy(parse_rules(c.capture), workloads=WorkloadSet(names or None, c.max_workloads))
        tap = VllmTap(self.model_runner, publisher, policy)
        original = self.model_runner.propose_draft_token_ids

        def propose(scheduled: Any, sampled: Any, metadata: Any, hidden: Any, sample_hidden: Any,
                    aux: Any, *rest: Any, **kw: Any) -> Any:  # fmt: skip
            if aux is not None:
                tap.step(scheduled, sampled, hidden, aux)
            return original(scheduled, sampled, metadata, hidden, sample_hidden, aux, *rest, **kw)

        self.model_runner.propose_draft_token_ids = propose
        self.tide_tap = (tap, publisher)

    def tide_flush_tap(self) -> dict[str, int]:
        """Publish what the tap holds; its counters."""
        self.tide_tap[1].flush()
        return self.tide_tap_stats()

    def tide_tap_stats(self) -> dict[str, int]:
        if not hasattr(self, "tide_tap"):
            return {}
        tap, publisher = self.tide_tap
        return {"events": tap.events, "failures": tap.failures,
                "pending_requests": len(publisher.pending_requests), **asdict(publisher.stats)}  # fmt: skip

    def tide_load_draft(self, folder: str) -> None:
        """The draft in `folder` (speculators format) in place of the drafter's weights, or an error
        and the drafter as it was."""
        from safetensors.torch import load_file

        drafter = self.model_runner.drafter
        config = drafter.vllm_config.speculative_config.draft_model_config
        serving = getattr(self, "tide_draft", config.model)  # the last swapped in, or the first
        weights = load_file(str(Path(folder) / "model.safetensors"))
        _check_fits(weights, Path(serving) / "model.safetensors")
        try:
            _reload(drafter.model, weights, config)
        except Exception:  # past the check nothing should fail; if it does, the last draft goes back
            _reload(drafter.model, load_file(str(Path(serving) / "model.safetensors")), config)
            raise
        self.tide_draft = folder


def _check_fits(weights: dict[str, torch.Tensor], serving: Path) -> None:
    """The same tensor names and shapes as the draft serving, whose weights vLLM loaded."""
    from safetensors import safe_open

    with safe_open(str(serving), "pt") as f:
        shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    new = {name: list(t.shape) for name, t in weights.items()}
    if new != shapes:
        wrong = sorted(n for n in shapes.keys() | new.keys() if shapes.get(n) != new.get(n))
        raise ValueError(f"the draft does not fit the drafter vLLM built: tensors {wrong} differ")
    for name, t in weights.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"the draft has non-finite values in {name}")


def _reload(model: torch.nn.Module, weights: dict[str, torch.Tensor], config: Any) -> None:
    """vLLM's in-place reload (its kernels' packed weights are made again from the new ones); the
    layers given no weights (the embedding shared with the target) keep theirs."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    try:
        model.load_weights(iter(weights.items()))  # type: ignore[operator]  # vLLM's model
    finally:
        finalize_layerwise_reload(model, config)
