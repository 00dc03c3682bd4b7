"""Exports of a draft folder for SGLang and for vLLM's speculators format.

SGLang cannot be installed here (CUDA only), so what its loader does is written down below as data,
from SGLang v0.5.23 (PyPI sglang==0.5.23, git tag v0.5.23), python/sglang/srt/models/llama_eagle3.py:
  L46-86    the draft decoder layer: qkv_proj = QKVParallelLinear(2 * hidden, head_dim, heads, kv_heads),
            LlamaMLP (gate_up_proj, down_proj), hidden_norm; input_layernorm and post_attention_layernorm
            come from the base LlamaDecoderLayer (python/sglang/srt/models/llama.py L307-368)
  L122-207  LlamaModel.__init__: embed_tokens (target vocab), fc = Linear(hidden * num_aux, hidden) with
            num_aux = len(eagle_config["eagle_aux_hidden_state_layer_ids"]) (L156-167), layers, norm
  L272-323  LlamaForCausalLMEagle3.__init__: lm_head = ParallelLMHead(draft_vocab_size, hidden) unless
            tie_word_embeddings (then it *is* the embedding)
  L325-378  load_weights: legacy "midlayer" -> "layers.0"; "d2t" -> hot_token_id = d2t + arange; "t2d"
            skipped; q/k/v_proj -> qkv_proj shards "q", "k", "v"; gate/up_proj -> gate_up_proj shards 0, 1;
            any other name goes to `name` or `model.` + name, and a name matching no parameter is
            silently ignored (so the test must prove that nothing is dropped).
Aux layer ids: python/sglang/srt/models/llama.py L929-941 (set_eagle3_layers_to_capture captures before
layer id + 1) and python/sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py
L186-196 (the ids come from eagle_config["eagle_aux_hidden_state_layer_ids"]).
Shard placement: python/sglang/srt/layers/linear.py L1181-1193 (q at 0, k after q, v after k) and
L813-814 (merged shard i at sum(output_sizes[:i])); the LM head loader asserts exactly draft_vocab_size
rows (python/sglang/srt/layers/vocab_parallel_embedding.py L436-441).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tide.models.eagle3 import DraftLoadError, Eagle3Draft
from tide.models.hf_folder import hf_config
from tide.models.loader import Target
from tide.trainers.export import export_all, export_sglang, export_speculators

from .conftest import tiny_draft, tiny_target

LAYERS = 8  # aux layers (2, 4, 5) in vLLM numbering: distinct, and SGLang's (1, 3, 4) are all >= 0
DRAFT_VOCAB = 96

# -- SGLang v0.5.23 as data -----------------------------------------------------------------------------
SGLANG_STACKED: list[tuple[str, str, str | int]] = [  # (fused param, checkpoint part, shard id), in order
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]
SGLANG_LEGACY = {"midlayer": "layers.0"}
SGLANG_SHARED = {"model.embed_tokens.weight"}  # replaced by the target's embedding (set_embed)


def sglang_params(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """named_parameters() of LlamaForCausalLMEagle3(config) at tensor-parallel size 1 (vocab padding aside)."""
    d, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    h, kvh = c["num_attention_heads"], c["num_key_value_heads"]
    n_aux = len(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    layer = "model.layers.0."
    return {
        "model.embed_tokens.weight": (c["vocab_size"], d),
        "model.fc.weight": (d, d * n_aux),
        layer + "self_attn.qkv_proj.weight": ((h + 2 * kvh) * hd, 2 * d),
        layer + "self_attn.o_proj.weight": (d, h * hd),
        layer + "mlp.gate_up_proj.weight": (2 * inter, d),
        layer + "mlp.down_proj.weight": (d, inter),
        layer + "input_layernorm.weight": (d,),
        layer + "post_attention_layernorm.weight": (d,),
        layer + "hidden_norm.weight": (d,),
        "model.norm.weight": (d,),
        "lm_head.weight": (c["draft_vocab_size"], d),
    }


def sglang_shard_rows(c: dict[str, Any]) -> dict[str | int, int]:
    hd, inter = c["head_dim"], c["intermediate_size"]
    return {
        "q": c["num_attention_heads"] * hd,
        "k": c["num_key_value_heads"] * hd,
        "v": c["num_key_value_heads"] * hd,
        0: inter,
        1: inter,
    }


def sglang_route(name: str, params: dict[str, tuple[int, ...]]) -> tuple[str, str | int | None]:
    """Where SGLang's load_weights puts a checkpoint tensor: (parameter, shard), or a special target."""
    for legacy, new in SGLANG_LEGACY.items():
        name = name.replace(legacy, new)
    if "d2t" in name:
        return "hot_token_id", None
    if "t2d" in name:
        return "skipped", None
    for fused, part, shard in SGLANG_STACKED:
        if part in name:
            name = name.replace(part, fused)
            dest = name if name in params else f"model.{name}"
            return (dest, shard) if dest in params else ("DROPPED", None)
    dest = name if name in params else f"model.{name}"
    return (dest, None) if dest in params else ("DROPPED", None)


def sglang_load(folder: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """SGLang's load of an exported folder: its parameters as full tensors, and hot_token_id."""
    cfg = json.loads((folder / "config.json").read_text())
    params = sglang_params(cfg)
    rows = sglang_shard_rows(cfg)
    shards: dict[str, dict[str | int | None, torch.Tensor]] = {}
    hot: torch.Tensor | None = None
    for name, t in load_file(str(folder / "model.safetensors")).items():
        dest, shard = sglang_route(name, params)
        assert dest != "DROPPED", f"SGLang would silently ignore {name}"
        if dest == "hot_token_id":
            hot = t + torch.arange(t.shape[0])
            continue
        if dest == "skipped":
            continue
        assert shard not in shards.get(dest, {}), f"{name} written twice"
        if shard is not None:
            assert t.shape == (rows[shard], params[dest][1]), (name, tuple(t.shape))
        else:
            assert tuple(t.shape) == params[dest], (name, tuple(t.shape), params[dest])
        shards.setdefault(dest, {})[shard] = t
    out = {}
    for dest, parts in shards.items():
        order = [s for _, _, s in SGLANG_STACKED if s in parts] if None not in parts else [None]
        out[dest] = torch.cat([parts[s] for s in order], 0)
        assert tuple(out[dest].shape) == params[dest], f"{dest} only partly loaded"
    missing = set(params) - set(out) - SGLANG_SHARED
    assert not missing, f"SGLang parameters left uninitialised: {sorted(missing)}"
    return out, hot


def to_ours(p: dict[str, torch.Tensor], hot: torch.Tensor, c: dict[str, Any]) -> dict[str, torch.Tensor]:
    """SGLang's loaded parameters back under our names: the inverse a reader of SGLang's model would do."""
    r = sglang_shard_rows(c)
    q, k, v = p["model.layers.0.self_attn.qkv_proj.weight"].split([r["q"], r["k"], r["v"]])
    t2d = torch.zeros(c["vocab_size"], dtype=torch.bool)
    t2d[hot] = True
    s = "model.layers.0."
    return {
        "fc.weight": p["model.fc.weight"],
        "midlayer.input_layernorm.weight": p[s + "input_layernorm.weight"],
        "midlayer.hidden_norm.weight": p[s + "hidden_norm.weight"],
        "midlayer.self_attn.q_proj.weight": q,
        "midlayer.self_attn.k_proj.weight": k,
        "midlayer.self_attn.v_proj.weight": v,
        "midlayer.self_attn.o_proj.weight": p[s + "self_attn.o_proj.weight"],
        "midlayer.post_attention_layernorm.weight": p[s + "post_attention_layernorm.weight"],
        "midlayer.mlp.gate_up_proj.weight": p[s + "mlp.gate_up_proj.weight"],  # SGLang's is [gate; up] too
        "midlayer.mlp.down_proj.weight": p[s + "mlp.down_proj.weight"],
        "norm.weight": p["model.norm.weight"],
        "lm_head.weight": p["lm_head.weight"],
        "d2t": hot - torch.arange(hot.shape[0]),
        "t2d": t2d,
    }


# -- fixtures ----------------------------------------------------------------------------------------------
def _draft(vocab: int = DRAFT_VOCAB) -> tuple[Target, Eagle3Draft]:
    """A tiny draft whose every tensor matters: a scattered vocabulary and norms that are not all ones."""
    # a RoPE base that is not the default, so that a reader who drops it computes other logits
    target = tiny_target(seed=31, layers=LAYERS, rope_theta=50000.0)
    draft = tiny_draft(target, vocab=vocab, seed=32)
    g = torch.Generator().manual_seed(33)
    with torch.no_grad():
        draft.set_vocab(torch.randperm(target.config.vocab_size, generator=g)[:vocab])
        draft.lm_head.weight.copy_(target.model.lm_head.weight[draft.target_ids()])
        for p in draft.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return target, draft


def _saved(tmp_path: Path, vocab: int = DRAFT_VOCAB) -> tuple[Target, Eagle3Draft, Path]:
    target, draft = _draft(vocab)
    draft.save(tmp_path / "draft")
    return target, draft, tmp_path / "draft"


def _logits(draft: Eagle3Draft, steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    b, t, d = 2, 9, draft.cfg.hidden_size
    aux = torch.randn(b, t, 3 * d, generator=g)
    tokens = [torch.randint(0, draft.cfg.target_vocab_size, (b, t), generator=g) for _ in range(steps)]
    with torch.no_grad():
        return [draft.logits(o) for o in draft.unrolled(aux, tokens, torch.arange(t).repeat(b, 1))]


# -- SGLang ------------------------------------------------------------------------------------------------
def test_sglang_config(tmp_path: Path) -> None:
    _, draft, folder = _saved(tmp_path)
    c = json.loads((export_sglang(folder, tmp_path / "sg") / "config.json").read_text())
    dc = draft.cfg
    assert c["architectures"] == ["LlamaForCausalLMEagle3"]
    assert list(dc.aux_layer_ids) == [2, 4, 5]
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang: ours - 1
    assert "eagle_aux_hidden_state_layer_ids" not in c  # only one place an engine could read it from
    assert c["tide"]["aux_layer_ids_vllm"] == [2, 4, 5]
    assert c["tide"]["aux_layer_ids_sglang"] == [1, 3, 4]
    assert c["tide"]["target_fingerprint"] == dc.target_fingerprint
    expected = {
        "hidden_size": dc.hidden_size,
        "intermediate_size": dc.intermediate_size,
        "num_attention_heads": dc.num_heads,
        "num_key_value_heads": dc.num_kv_heads,
        "head_dim": dc.head_dim,
        "rms_norm_eps": dc.rms_eps,
        "rope_theta": dc.rope_theta,
        "rope_scaling": dc.rope_scaling,
        "max_position_embeddings": dc.max_position,
        "vocab_size": 256,
        "draft_vocab_size": DRAFT_VOCAB,
        "num_hidden_layers": 1,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "model_type": "llama",
    }
    assert {k: c[k] for k in expected} == expected


def test_sglang_weights_have_exactly_the_names_and_shapes_sglang_loads(tmp_path: Path) -> None:
    _, draft, folder = _saved(tmp_path)
    out = export_sglang(folder, tmp_path / "sg")
    c = json.loads((out / "config.json").read_text())
    d, inter, hd, h, kvh = 64, 128, 16, 4, 2
    want = {
        "fc.weight": (d, 3 * d),
        "midlayer.input_layernorm.weight": (d,),
        "midlayer.hidden_norm.weight": (d,),
        "midlayer.self_attn.q_proj.weight": (h * hd, 2 * d),
        "midlayer.self_attn.k_proj.weight": (kvh * hd, 2 * d),
        "midlayer.self_attn.v_proj.weight": (kvh * hd, 2 * d),
        "midlayer.self_attn.o_proj.weight": (d, h * hd),
        "midlayer.post_attention_layernorm.weight": (d,),
        "midlayer.mlp.gate_proj.weight": (inter, d),
        "midlayer.mlp.up_proj.weight": (inter, d),
        "midlayer.mlp.down_proj.weight": (d, inter),
        "norm.weight": (d,),
        "lm_head.weight": (DRAFT_VOCAB, d),
        "d2t": (DRAFT_VOCAB,),
        "t2d": (256,),
    }
    got = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in got.items()} == want  # no embed_tokens: SGLang shares the target's
    assert got["d2t"].dtype == torch.int64 and got["t2d"].dtype == torch.bool

    params, hot = sglang_load(out)  # every tensor lands in a parameter, every parameter is filled
    assert set(params) == set(sglang_params(c)) - SGLANG_SHARED
    assert hot is not None and torch.equal(hot, draft.target_ids())
    assert int(got["t2d"].sum()) == DRAFT_VOCAB and bool(got["t2d"][hot].all())


def test_sglang_weights_loaded_back_give_the_same_logits(tmp_path: Path) -> None:
    target, draft, folder = _saved(tmp_path)
    out = export_sglang(folder, tmp_path / "sg")
    params, hot = sglang_load(out)
    assert hot is not None
    back = Eagle3Draft(draft.cfg, target.model.embed_tokens)
    back.load_state_dict(to_ours(params, hot, json.loads((out / "config.json").read_text())), strict=True)
    back.eval()
    for ours, theirs in zip(_logits(draft), _logits(back), strict=True):
        assert torch.equal(ours, theirs)
    assert torch.equal(back.target_ids(), draft.target_ids())


# -- vLLM speculators --------------------------------------------------------------------------------------
def _verifier_folder(target: Target, folder: Path) -> Path:
    """The target as an HF folder holding what speculators reads from a verifier (config, embed, head, norm)."""
    folder.mkdir()
    hf = {**hf_config(target.config), "tie_word_embeddings": False}  # the head is written below
    (folder / "config.json").write_text(json.dumps(hf))
    m = target.model
    weights = {
        "model.embed_tokens.weight": m.embed_tokens.weight,
        "lm_head.weight": m.lm_head.weight,
        "model.norm.weight": m.norm.weight,
    }
    save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    return folder


def test_speculators_config_has_what_vllm_reads(tmp_path: Path) -> None:
    # vLLM main, vllm/transformers_utils/configs/speculators/base.py (validate_speculators_config) and
    # algos.py (update_eagle3: norm_before_residual defaults to True when the key is missing)
    _, draft, folder = _saved(tmp_path)
    c = json.loads((export_speculators(folder, tmp_path / "sp") / "config.json").read_text())
    assert c["speculators_model_type"] == "eagle3"
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert "name_or_path" in c["speculators_config"]["verifier"]
    assert isinstance(c["transformer_layer_config"], dict)
    assert c["norm_before_residual"] is False
    assert c["draft_vocab_size"] == DRAFT_VOCAB
    assert c["eagle_aux_hidden_state_layer_ids"] == list(draft.cfg.aux_layer_ids) == [2, 4, 5]
    assert c["transformer_layer_config"]["vocab_size"] == 256
    assert c["transformer_layer_config"]["num_hidden_layers"] == 1


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("vocab", [DRAFT_VOCAB, 256])
def test_speculators_package_loads_the_export(tmp_path: Path, vocab: int) -> None:
    from speculators import SpeculatorModelConfig
    from speculators.models import Eagle3DraftModel, Eagle3SpeculatorConfig

    target, draft, folder = _saved(tmp_path, vocab)
    verifier = _verifier_folder(target, tmp_path / "verifier")
    out = export_speculators(folder, tmp_path / "sp", verifier_name_or_path=str(verifier))
    exported = load_file(str(out / "model.safetensors"))
    assert ("d2t" in exported) == (vocab < 256)  # speculators has no vocab maps for a full vocabulary

    cfg = SpeculatorModelConfig.from_pretrained(out)
    assert isinstance(cfg, Eagle3SpeculatorConfig)
    assert cfg.draft_vocab_size == vocab and cfg.target_vocab_size == 256
    assert cfg.eagle_aux_hidden_state_layer_ids == [2, 4, 5] and cfg.norm_before_residual is False

    # strict: the export is exactly the model's state minus what speculators takes from the verifier
    verifier_owned = {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"}
    fresh = Eagle3DraftModel(cfg)
    assert set(fresh.state_dict()) == set(exported) | verifier_owned
    owned = {k: torch.zeros_like(v) for k, v in fresh.state_dict().items() if k in verifier_owned}
    fresh.load_state_dict({**exported, **owned}, strict=True)

    # the package's own loading path, verifier weights included
    model = Eagle3DraftModel.from_pretrained(out)
    state = model.state_dict()
    for name, tensor in exported.items():
        assert torch.equal(state[name], tensor), name
    # the verifier's head, restricted to the draft vocabulary through our t2d, is the draft's reference
    head = target.model.lm_head.weight
    assert torch.equal(state["verifier_lm_head.weight"], head[exported["t2d"]] if vocab < 256 else head)
    # (embed_tokens is not checked: with transformers newer than speculators 0.9.0 pins, from_pretrained
    # leaves it as uninitialised memory instead of NaN, so the verifier's is not always copied in)

    # and its modules compute our draft's first step: q/k/v, gate/up, norms and RoPE all line up
    model.config.transformer_layer_config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(6)
    b, t = 2, 9
    aux = torch.randn(b, t, 3 * draft.cfg.hidden_size, generator=g)
    tokens = torch.randint(0, 256, (b, t), generator=g)
    pos = torch.arange(t).repeat(b, 1)
    mask = torch.full((t, t), float("-inf")).triu(1).expand(b, 1, t, t)
    with torch.no_grad():
        ours = draft.logits(draft.unrolled(aux, [tokens], pos)[0])
        x = torch.cat([target.model.embed_tokens(tokens), model.fc(aux)], -1)  # the shared embedding
        rope = model.rotary_emb(x, pos)
        out_h = model.layers[0](x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        theirs = model.lm_head(model.norm(out_h)).float()
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)


# -- both --------------------------------------------------------------------------------------------------
def test_export_all_writes_both_into_the_draft_folder(tmp_path: Path) -> None:
    target, draft, folder = _saved(tmp_path)
    paths = export_all(folder)
    assert paths == {"sglang": folder / "sglang", "speculators": folder / "speculators"}
    for p in paths.values():
        assert (p / "config.json").is_file() and (p / "model.safetensors").is_file()
    # the draft folder is still a draft folder
    loaded = Eagle3Draft.load(
        folder, target.model.embed_tokens, target.config, target.fingerprint, torch.float32
    )
    assert torch.equal(loaded.target_ids(), draft.target_ids())


def test_refuses_what_is_not_a_draft_folder(tmp_path: Path) -> None:
    _, _, folder = _saved(tmp_path)
    sg = export_sglang(folder, tmp_path / "sg")
    with pytest.raises(DraftLoadError, match="not a tide-eagle3"):
        export_sglang(sg, tmp_path / "again")
    state = load_file(str(folder / "model.safetensors"))
    state["midlayer.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(DraftLoadError, match="q_norm"):
        export_speculators(folder, tmp_path / "sp")
