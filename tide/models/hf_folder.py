"""The target as a Hugging Face folder (config, safetensors, tokenizer): what other engines load.

The weights are written in fp32 under their Hugging Face names, exactly as the loader read them,
so the folder's fingerprint is the source's: records captured by an engine serving the folder
name the same target as records captured by TIDE's engine serving the GGUF.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tide.config import cache_dir
from tide.models.llama import LlamaConfig
from tide.models.loader import read_target


def hf_config(cfg: LlamaConfig) -> dict[str, Any]:
    """`config.json` for a Llama-family target (what `read_hf_folder` reads back)."""
    c: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias,
        "torch_dtype": "float32",
    }
    if cfg.rope_scaling is not None:
        c["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.bos_token_id is not None:
        c["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_ids:
        c["eos_token_id"] = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)
    return c


def write_hf_folder(model: str | os.PathLike[str] | None, out: Path | None = None) -> tuple[Path, str]:
    """Write the target (a GGUF, an HF folder, or the default model) as an HF folder, at `out` or in
    the cache (one per fingerprint); returns the folder and the fingerprint. A folder already written
    for the same fingerprint is kept."""
    from safetensors.numpy import save_file

    _, cfg, weights, tokenizer, fp = read_target(model)
    out = out or cache_dir() / "hf" / fp[:12]
    stamp = out / "tide_fingerprint"
    if stamp.exists() and stamp.read_text() == fp:
        return out, fp
    if cfg.qk_norm:
        raise ValueError("only Llama-architecture targets can be written as an HF folder here")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    kept = {k: v for k, v in weights.items() if not (k == "lm_head.weight" and cfg.tie_embeddings)}
    save_file(kept, str(out / "model.safetensors"))
    tokenizer.hf.save_pretrained(str(out))
    stamp.write_text(fp)
    return out, fp
