"""Export a TIDE draft folder to the formats serving engines load: SGLang's EAGLE-3 and vLLM's speculators.

Both engines want the HF/EAGLE naming: separate q/k/v and gate/up projections (our MLP fuses gate and up,
gate first), `fc`, `norm`, `lm_head` over the draft vocabulary, `d2t` offsets and the `t2d` mask, and no
embedding (both share the target's). They differ in three places:

- SGLang (checked against sglang 0.5.23, `python/sglang/srt/models/llama_eagle3.py`) reads the decoder
  layer as `midlayer.*` (0.5.23 also accepts `layers.0.*`; older releases only `midlayer.*`), and the aux
  layer ids from `eagle_config.eagle_aux_hidden_state_layer_ids` counted one lower than ours: it adds 1
  back and captures the residual stream *before* that layer (`set_eagle3_layers_to_capture`).
- speculators (checked against speculators 0.9.0, `speculators/models/eagle3/`) names it `layers.0.*`,
  keeps the Llama fields in `transformer_layer_config`, and counts aux ids as we do (vLLM numbering).
  It has no `d2t`/`t2d` buffers when the draft vocabulary is the whole target vocabulary.
- vLLM assumes `norm_before_residual: true` when the key is missing; ours adds the raw hidden state, so
  the key is always written as false.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tide.models.eagle3 import DRAFT_FORMAT, DraftConfig, DraftLoadError, read_folder

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"  # what the speculators Eagle3 config writes by default
SPECULATORS_FORMAT_VERSION = "0.9.0"  # the speculators release whose loader the tests run
DEFAULT_SPECULATIVE_TOKENS = 3  # vLLM takes num_speculative_tokens from here unless told otherwise

# our name inside the decoder layer -> the HF/EAGLE name (gate_up_proj is split separately)
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attn.q_proj.weight": "self_attn.q_proj.weight",
    "self_attn.k_proj.weight": "self_attn.k_proj.weight",
    "self_attn.v_proj.weight": "self_attn.v_proj.weight",
    "self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = ("fc.weight", "norm.weight", "lm_head.weight")


def read_draft(draft_dir: Path) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """The config and raw tensors of a TIDE draft folder, without needing its target at hand."""
    return read_folder(draft_dir)


def hf_state(cfg: DraftConfig, state: dict[str, torch.Tensor], layer_prefix: str) -> dict[str, torch.Tensor]:
    """Our tensors under HF/EAGLE names, the decoder layer under `layer_prefix` (`midlayer.` or `layers.0.`).

    Every tensor of the draft must be placed: a weight we do not know how to export is an error, never
    silently dropped.
    """
    src = dict(state)

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise DraftLoadError(f"draft has no tensor {name}")
        return src.pop(name)

    out: dict[str, torch.Tensor] = {}
    for name in _TOP_NAMES:
        out[name] = take(name)
    for ours, theirs in _LAYER_NAMES.items():
        out[layer_prefix + theirs] = take("midlayer." + ours)
    # our MLP computes gate, up = gate_up_proj(x).split(inter): rows [0, inter) are gate, the rest up
    gate, up = take("midlayer.mlp.gate_up_proj.weight").split(cfg.intermediate_size, dim=0)
    out[layer_prefix + "mlp.gate_proj.weight"] = gate
    out[layer_prefix + "mlp.up_proj.weight"] = up
    out["d2t"] = take("d2t").to(torch.int64)  # target_id = draft_id + d2t[draft_id]
    out["t2d"] = take("t2d").to(torch.bool)  # which target ids the draft can say
    if src:
        raise DraftLoadError(f"draft holds tensors the export does not know: {sorted(src)}")
    return {k: v.contiguous() for k, v in out.items()}


def sglang_aux_layer_ids(cfg: DraftConfig) -> list[int]:
    # SGLang captures before layer (id + 1), so its id is ours minus one
    return [i - 1 for i in cfg.aux_layer_ids]


def _dtype_name(state: dict[str, torch.Tensor]) -> str:
    return str(state["fc.weight"].dtype).removeprefix("torch.")


def _llama_fields(cfg: DraftConfig, dtype: str) -> dict[str, Any]:
    """The Llama config fields of the one draft decoder layer, as HF's LlamaConfig spells them."""
    return {
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position,
        "vocab_size": cfg.target_vocab_size,  # the embedding is the target's, over its whole vocabulary
        "num_hidden_layers": 1,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,  # True would make SGLang use the embedding as the draft's LM head
        "torch_dtype": dtype,
    }


def _provenance(cfg: DraftConfig) -> dict[str, Any]:
    # both numberings spelled out, so nobody has to remember which engine counts from where
    return {
        "format": DRAFT_FORMAT,
        "target_fingerprint": cfg.target_fingerprint,
        "version": cfg.version,
        "aux_layer_ids_vllm": list(cfg.aux_layer_ids),
        "aux_layer_ids_sglang": sglang_aux_layer_ids(cfg),
        "aux_layer_ids_meaning": "vllm: residual stream before decoder layer i; sglang: output of layer i",
    }


def _write(out_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def sglang_config(cfg: DraftConfig, dtype: str) -> dict[str, Any]:
    return {
        "architectures": [SGLANG_ARCHITECTURE],
        **_llama_fields(cfg, dtype),
        "draft_vocab_size": cfg.draft_vocab_size,  # None would make SGLang take the target's LM head
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_aux_layer_ids(cfg),
            "use_aux_hidden_state": True,
        },
        "tide": _provenance(cfg),
    }


def export_sglang(draft_dir: Path, out_dir: Path) -> Path:
    """Write `out_dir` as an SGLang EAGLE-3 draft (`--speculative-draft-model-path`)."""
    cfg, state = read_draft(draft_dir)
    tensors = hf_state(cfg, state, "midlayer.")
    return _write(out_dir, sglang_config(cfg, _dtype_name(state)), tensors)


def speculators_config(
    cfg: DraftConfig,
    dtype: str,
    verifier_name_or_path: str | None = None,
    speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
) -> dict[str, Any]:
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_FORMAT_VERSION,
        "transformer_layer_config": _llama_fields(cfg, dtype),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": None,  # the draft's hidden size is the target's
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            # The target is known here only by fingerprint. vLLM only needs the key (the target then comes
            # from its command line), but speculators 0.9.0's own from_pretrained needs a real HF folder or id.
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": ["LlamaForCausalLM"]},
        },
        "tide": _provenance(cfg),
    }


def export_speculators(
    draft_dir: Path,
    out_dir: Path,
    *,
    verifier_name_or_path: str | None = None,
    speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
) -> Path:
    """Write `out_dir` in vLLM's speculators format (`speculators_model_type: eagle3`)."""
    cfg, state = read_draft(draft_dir)
    tensors = hf_state(cfg, state, "layers.0.")
    if cfg.draft_vocab_size == cfg.target_vocab_size:
        # speculators registers no d2t/t2d when the vocabularies are the same; ours is then the identity
        if bool(tensors["d2t"].any()) or not bool(tensors["t2d"].all()):
            raise DraftLoadError(f"{draft_dir}: full draft vocabulary but d2t/t2d are not the identity")
        del tensors["d2t"], tensors["t2d"]
    config = speculators_config(cfg, _dtype_name(state), verifier_name_or_path, speculative_tokens)
    return _write(out_dir, config, tensors)


def export_all(draft_dir: Path, *, verifier_name_or_path: str | None = None) -> dict[str, Path]:
    """Both exports inside the draft folder itself, so the artifact carries them (see DESIGN: draft artifact)."""
    return {
        "sglang": export_sglang(draft_dir, draft_dir / "sglang"),
        "speculators": export_speculators(
            draft_dir, draft_dir / "speculators", verifier_name_or_path=verifier_name_or_path
        ),
    }
