"""The target model: logits equal transformers' on the same weights (fp32), for every supported variant."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tide.models.llama import Batch
from tide.models.loader import build_model, load_target, read_hf_folder


def _our_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.logits(model.forward_once(torch.tensor([ids])).hidden)[0]


def test_default_model_matches_transformers(target_fp32) -> None:
    from transformers import AutoModelForCausalLM

    path = target_fp32.path
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = target_fp32.tokenizer.chat_prompt(
        [{"role": "user", "content": "Write a haiku about the sea, then translate it to French."}]
    )
    ours = _our_logits(target_fp32.model, ids)
    with torch.inference_mode():
        theirs = ref(torch.tensor([ids])).logits[0]
    assert ours.shape == theirs.shape == (len(ids), 49152)
    assert torch.allclose(ours, theirs, atol=2e-3, rtol=1e-4), (ours - theirs).abs().max()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_fingerprint_identifies_the_target(target_fp32) -> None:
    fp = target_fp32.fingerprint
    assert len(fp) == 64 and int(fp, 16) >= 0
    # computed from the source weights, not the serving dtype
    assert load_target(dtype=torch.bfloat16, pack=False).fingerprint == fp


VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    "llama3_scaling": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "untied": ("llama", {"tie_word_embeddings": False}),
    "qwen2_bias": ("qwen2", {}),
    "qwen3_qk_norm": ("qwen3", {"head_dim": 16}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hf_folder_variants_match_transformers(variant: str, tmp_path: Path) -> None:
    import transformers

    kind, extra = VARIANTS[variant]
    common: dict[str, object] = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    common.update(extra)
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    ref = cls[1](cls[0](**common)).eval()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    cfg, weights = read_hf_folder(tmp_path)
    model = build_model(cfg, weights)
    ids = torch.randint(0, 300, (40,)).tolist()
    ours = _our_logits(model, ids)
    with torch.inference_mode():
        theirs = ref(torch.tensor([ids])).logits[0]
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()


def test_cache_batching_equals_one_pass(target_fp32) -> None:
    """Prefill then token-by-token decoding through the cache gives the one-pass logits."""
    model = target_fp32.model
    ids = target_fp32.tokenizer.encode("The quick brown fox jumps over the lazy dog because it was")
    full = _our_logits(model, ids)
    cache = model.new_cache(2, 64)
    with torch.inference_mode():
        k = 6
        model(torch.tensor([ids[:k]]), Batch.make(1, torch.arange(k).unsqueeze(0), None, 64), cache, False)
        for i in range(k, len(ids)):
            out = model(torch.tensor([[ids[i]]]), Batch.make(1, torch.tensor([[i]]), None, 64), cache, False)
            step = model.logits(out.hidden)[0, 0]
            assert torch.allclose(step, full[i], atol=1e-3), (i, (step - full[i]).abs().max())
