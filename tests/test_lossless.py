"""On the default model in fp32: greedy output with speculation equals greedy output without it."""

from __future__ import annotations

import torch

from tide.models.loader import load_target
from tide.prompts import load_prompts, split
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams

from .conftest import WORKLOADS


def _prompts(target, n: int) -> list[list[int]]:
    items = []
    for name in ("code", "chat_en", "math", "chat_fr"):
        items += split(load_prompts(WORKLOADS / f"{name}.jsonl"), "test")[: n // 4]
    return [p.token_ids(target.tokenizer) for p in items]


def test_greedy_speculation_is_token_identical_in_fp32(target_fp32, trained_draft_dir) -> None:
    prompts = _prompts(target_fp32, 16)
    params = SamplingParams(max_tokens=16)
    base = Engine(target_fp32, None, EngineConfig(max_batch=16, max_model_len=256, gamma=0))
    ref = [s.output for s in base.generate(prompts, params)]
    accepted = 0
    # every gamma once, at batch sizes that pad differently; batch 1 on one prompt of each workload
    # (a sequence at a time costs a decode step per token or burst: 33 s for all 16 on 2 cores)
    for batch, gamma, rows in ((1, 3, slice(None, None, 4)), (4, 1, slice(None)), (4, 5, slice(None)),
                               (16, 2, slice(None)), (16, 4, slice(None))):  # fmt: skip
        engine = Engine(target_fp32, None, EngineConfig(max_batch=batch, max_model_len=256, gamma=gamma))
        engine.load_draft(trained_draft_dir)
        out = [s.output for s in engine.generate(prompts[rows], params)]
        mismatched = [i for i, (a, b) in enumerate(zip(ref[rows], out, strict=True)) if a != b]
        assert not mismatched, f"batch {batch}, gamma {gamma}: prompts {mismatched} differ"
        accepted += int(engine.stats.accepted.sum())
    assert accepted > 0  # the trained draft was right often enough to exercise multi-token acceptance


def test_greedy_speculation_is_token_identical_on_the_gguf_blocks(trained_draft_dir) -> None:
    """The default weight mode: the file's own 4-bit blocks through torch's int4 kernel (fp32
    activations, so only the rule can part the outputs, not rounding). Torch's int4 kernel has no
    fast fp32 path (0.1 s a decode step), so the prompts are each prompt's last 16 tokens (the end of
    its question and the assistant's header)."""
    target = load_target(dtype=torch.float32, weights="gguf")
    assert target.weights == "gguf"
    prompts = [p[-16:] for p in _prompts(target, 4)]
    params = SamplingParams(max_tokens=12)
    base = Engine(target, None, EngineConfig(max_batch=4, max_model_len=64, gamma=0))
    ref = [s.output for s in base.generate(prompts, params)]
    accepted = 0
    for batch, gamma, rows in ((1, 3, slice(0, 1)), (4, 3, slice(None))):
        engine = Engine(target, None, EngineConfig(max_batch=batch, max_model_len=64, gamma=gamma))
        engine.load_draft(trained_draft_dir)
        out = [s.output for s in engine.generate(prompts[rows], params)]
        assert out == ref[rows], f"batch {batch}, gamma {gamma}"
        accepted += int(engine.stats.accepted.sum())
    assert accepted > 0


def test_greedy_with_the_hybrid_proposer_is_token_identical_in_fp32(target_fp32, trained_draft_dir) -> None:
    """The learned draft and the suffix index side by side: each prompt twice, so that the second
    time the index holds the first answer and proposes long runs of it."""
    prompts = _prompts(target_fp32, 8)[::2]
    params = SamplingParams(max_tokens=24)
    base = Engine(target_fp32, None, EngineConfig(max_batch=4, max_model_len=256, gamma=0))
    ref = [s.output for s in base.generate(prompts, params)]
    for batch in (1, 4):
        cfg = EngineConfig(max_batch=batch, max_model_len=256, gamma=3, proposer="hybrid")
        engine = Engine(target_fp32, None, cfg)
        engine.load_draft(trained_draft_dir)
        out = [s.output for s in engine.generate(prompts + prompts, params)]
        assert out == ref + ref, f"batch {batch}"
        assert engine.suffix is not None and engine.stats.steps > 0
        assert sum(s.accepted_tokens for s in engine.suffix.stats.values()) > 0


def test_sampled_speculation_runs_on_the_default_model(target_native, trained_draft_dir) -> None:
    """The serving dtype, sampling, stop strings and max_tokens inside accepted bursts: well-formed results."""
    prompts = _prompts(target_native, 8)
    engine = Engine(target_native, None, EngineConfig(max_batch=4, max_model_len=256, gamma=4))
    engine.load_draft(trained_draft_dir)
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=i, max_tokens=5 + i) for i in range(8)]
    seqs = engine.generate(prompts, params)
    for s, p in zip(seqs, params, strict=True):
        assert 1 <= len(s.output) <= p.max_tokens
        assert s.finish_reason in ("stop", "length")
        assert all(0 <= t < target_native.config.vocab_size for t in s.output)
    # a stop string ends the output right before it, wherever in a burst it falls
    tok = target_native.tokenizer
    ref = Engine(target_native, None, EngineConfig(max_batch=1, max_model_len=256, gamma=0)).generate(
        prompts[:1], SamplingParams(max_tokens=40)
    )[0]
    text = tok.decode(ref.output)
    stop = text[10:14]
    engine2 = Engine(target_native, None, EngineConfig(max_batch=1, max_model_len=256, gamma=4))
    engine2.load_draft(trained_draft_dir)
    s = engine2.generate(prompts[:1], SamplingParams(max_tokens=40, stop=(stop,)))[0]
    assert s.finish_reason == "stop"
    assert s.text == text[: text.find(stop)]
    assert torch.is_tensor(engine2.stats.attempted)
