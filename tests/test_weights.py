"""Weight modes (`tide.models.weights`): the GGUF's own 4-bit blocks, and speculation lossless in every mode."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tide.cli import app
from tide.models.aot import package_key
from tide.models.loader import default_model_path, read_target
from tide.models.weights import (
    GGUFBlockError,
    Int4Blocks,
    Int4Linear,
    Int8Linear,
    int4_draft,
    quantize_linears,
    read_gguf_blocks,
)
from tide.prompts import WORKLOADS
from tide.serving.engine import Engine, EngineConfig
from tide.serving.sampling import SamplingParams

from .conftest import tiny_target, trained_tiny_draft


def test_gguf_blocks_are_the_files_weights() -> None:
    """Read as 4-bit blocks, every decoder linear of the shipped Q4_1 file is the weight the loader
    dequantizes (q/k rows un-permuted, q/k/v and gate/up fused as the model fuses them)."""
    _, cfg, weights, _, _ = read_target(None)
    blocks = read_gguf_blocks(default_model_path(), cfg.num_heads, cfg.num_kv_heads)
    assert len(blocks) == 4 * cfg.num_layers
    for i in (0, cfg.num_layers - 1):
        p = f"model.layers.{i}."
        dense = {
            "self_attn.qkv_proj": np.concatenate([weights[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
            "self_attn.o_proj": weights[p + "self_attn.o_proj.weight"],
            "mlp.gate_up_proj": np.concatenate(
                [weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]
            ),
            "mlp.down_proj": weights[p + "mlp.down_proj.weight"],
        }
        for name, w in dense.items():
            b = blocks[f"layers.{i}.{name}"]
            assert int(b.q.max()) <= 15
            got = b.dequantize()
            # the same values up to fp32 rounding of d * q + m against (q - 8) * d + (m + 8d)
            assert torch.allclose(got, torch.from_numpy(w), rtol=0, atol=1e-5), name


def test_int4_blocks_round_trip_and_the_kernel_computes_them() -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    b = Int4Blocks.quantize(w)
    step = (b.scale * 15).amax()
    assert (b.dequantize() - w).abs().max() <= step / 15  # a step at most (rounding: half of one)
    x = torch.randn(3, 5, 64)
    int8 = Int8Linear(w, None, torch.float32)
    assert (int8.qweight.float() * int8.scale[:, None] - w).abs().max() <= int8.scale.max() / 2 + 1e-6
    for layer, dense in (
        (Int4Linear(b, None, torch.float32), b.dequantize()),
        (int8, int8.qweight.float() * int8.scale[:, None]),
    ):
        y = layer(x)
        assert y.shape == (3, 5, 96)
        assert torch.allclose(y, x @ dense.T, atol=1e-4), type(layer).__name__


def test_a_file_without_4_bit_blocks_is_refused_for_gguf_mode(tmp_path) -> None:
    import gguf

    path = tmp_path / "f16.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFBlockError, match="F16"):
        read_gguf_blocks(path, 4, 4)
    target = tiny_target(seed=0)
    with pytest.raises(GGUFBlockError, match="needs a gguf"):
        quantize_linears(target.model, "gguf", None)
    assert quantize_linears(target.model, "auto", path) == "bf16"  # auto: dense where the file has no blocks
    with pytest.raises(ValueError, match="weights must be one of"):
        quantize_linears(target.model, "int3", None)


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "weights", "--modes", "int3"],
        [
            "draft",
            "train",
            "--prompts",
            str(WORKLOADS / "code.jsonl"),
            "--out",
            "unused",
            "--weights",
            "int3",
        ],
        ["draft", "ensure-default", "--weights", "int3"],
    ],
)
def test_an_unknown_weight_mode_is_refused_before_anything_loads(args: list[str]) -> None:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "--weights" in res.output


@pytest.mark.parametrize(("mode", "compiled"), [("int8", False), ("int4", False), ("int4", True)])
def test_greedy_speculation_is_lossless_in_each_weight_mode(mode: str, compiled: bool) -> None:
    """The draft learns the quantized target, then: greedy with speculation == greedy without, in
    the same mode (and with compiled layers), at batch 1 and 4."""
    target = tiny_target(seed=5, scale=2.0)
    assert quantize_linears(target.model, mode) == mode
    if compiled:
        target.weights = mode
        assert target.compile()
    draft = trained_tiny_draft(target, seed=6, vocab=128, steps=100)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(12)]  # fmt: skip
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = [
        s.output
        for s in Engine(target, None, EngineConfig(max_batch=1, max_model_len=64, gamma=0)).generate(
            prompts, params
        )
    ]
    for batch, gamma in ((1, 3), (4, 2), (4, 5)):
        engine = Engine(target, draft, EngineConfig(max_batch=batch, max_model_len=64, gamma=gamma))
        assert [s.output for s in engine.generate(prompts, params)] == ref, (batch, gamma)
        assert engine.stats.accepted.sum() > 0


def test_compiled_layers_match_the_eager_layers_in_each_shape_class() -> None:
    """The packages compiled ahead of time (`tide.models.aot`) give the eager layers' outputs and
    cache writes for decode, verify and prefill at batch 1 and 2; a pass with a single key, which
    no package covers, is left to the eager layers. The weights are an input: two targets of one
    architecture share the packages, and each gets its own layers' outputs."""
    from tide.models.llama import Batch

    keys = set()
    for seed in (5, 6):
        target = tiny_target(seed=seed, scale=2.0)
        with torch.no_grad():  # the norms' gains too differ by layer
            for p in target.model.stack.parameters():
                if p.dim() == 1:
                    p.normal_(1.0, 0.1)
        target.weights = quantize_linears(target.model, "int4")
        assert target.compile()
        model, compiled = target.model, target.model.compiled
        assert compiled is not None
        g = torch.Generator().manual_seed(1)
        for b, t, start in ((1, 1, 7), (1, 4, 7), (2, 1, 9), (2, 3, 9), (1, 12, 0)):
            caches = [model.new_cache(3, 40) for _ in range(2)]
            for c in caches[1:]:
                c.k.copy_(caches[0].k.normal_(generator=g))
                c.v.copy_(caches[0].v.normal_(generator=g))
            pos = (start + torch.arange(t)).repeat(b, 1)
            batch = Batch.make(1, pos, None, 40)
            x = torch.randn(b, t, model.cfg.hidden_size, generator=g)
            with torch.inference_mode():  # as the engine calls them
                eager = model.stack(x, pos, batch.write_positions, batch.mask, *caches[0].rows(1, b))
                got = compiled(x, pos, batch.write_positions, batch.mask, *caches[1].rows(1, b))
            assert got is not None, (b, t)
            torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(caches[1].v, caches[0].v, rtol=1e-4, atol=1e-4)
        first = Batch.make(0, torch.zeros(1, 1, dtype=torch.long), None, 40)
        ks, vs = model.new_cache(1, 40).rows(0, 1)
        x = torch.randn(1, 1, model.cfg.hidden_size)
        with torch.inference_mode():
            assert compiled(x, first.positions, first.write_positions, first.mask, ks, vs) is None
        # one copy of the weights: what changes in the model's layers changes in the compiled ones
        with torch.no_grad():
            model.get_parameter("layers.1.input_layernorm.weight").mul_(1.5)
            model.get_buffer("layers.0.mlp.down_proj.scales_and_zeros").mul_(0.5)
        batch = Batch.make(1, torch.tensor([[9]]), None, 40)
        caches = [model.new_cache(3, 40) for _ in range(2)]
        with torch.inference_mode():
            eager = model.stack(x, batch.positions, batch.write_positions, batch.mask, *caches[0].rows(1, 1))
            got = compiled(x, batch.positions, batch.write_positions, batch.mask, *caches[1].rows(1, 1))
        assert got is not None
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
        keys.add(package_key(target.model))
    assert len(keys) == 1


def test_the_compiled_draft_step_matches_the_eager_step_for_any_draft() -> None:
    """The draft step compiled with the target (`CompiledDraftStep`) takes the draft's tensors as
    an input: two drafts of different weights and vocabularies each get the eager step's output,
    logits and cache writes in every shape class; a draft of another dtype or left dense, which no
    package fits, is left to the eager step."""
    from tide.models.eagle3 import DraftConfig, Eagle3Draft
    from tide.models.llama import Batch

    target = tiny_target(seed=5, scale=2.0)
    target.weights = quantize_linears(target.model, "int4")
    assert target.compile()
    step, cfg = target.draft_step, target.model.cfg
    assert step.runners
    g = torch.Generator().manual_seed(2)
    for seed, vocab in ((1, 64), (2, 128)):
        torch.manual_seed(seed)
        dense = Eagle3Draft(DraftConfig.for_target(cfg, target.fingerprint, vocab), target.model.embed_tokens)
        draft = int4_draft(copy.deepcopy(dense))  # as `DraftSet` serves it
        for b, t, start in ((1, 1, 7), (1, 4, 7), (2, 1, 9), (2, 3, 9)):
            caches = [draft.new_cache(3, 40, torch.float32) for _ in range(2)]
            caches[0].k.normal_(generator=g)
            caches[0].v.normal_(generator=g)
            caches[1].k.copy_(caches[0].k)
            caches[1].v.copy_(caches[0].v)
            pos = (start + torch.arange(t)).repeat(b, 1)
            batch = Batch.make(0, pos, None, 40)
            hidden = torch.randn(b, t, cfg.hidden_size, generator=g)
            tokens = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
            pick = torch.randint(0, t, (b,), generator=g)
            args = (hidden, tokens, pos, batch.write_positions, batch.mask)
            with torch.inference_mode():
                eager = draft.layer(*args, caches[0].k[1 : 1 + b], caches[0].v[1 : 1 + b], pick)
                got = step(draft.layer_state, *args, caches[1].k[1 : 1 + b], caches[1].v[1 : 1 + b], pick)
            assert got is not None, (seed, b, t)
            assert got[1].shape == (b, vocab) and got[1].dtype == torch.float32
            torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
            # the logits are the head's at each row's `pick`
            torch.testing.assert_close(eager[1], draft.logits(eager[0][torch.arange(b), pick]))
            torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(caches[1].v, caches[0].v, rtol=1e-4, atol=1e-4)
    # a chain's token ids as a column of a wider tensor: the package reads them as the eager step does
    draft.compiled = step
    pos = torch.tensor([[9], [12]])
    wide = torch.randint(0, cfg.vocab_size, (2, 3), generator=g)
    hidden = torch.randn(2, 1, cfg.hidden_size, generator=g)
    pick = torch.zeros(2, dtype=torch.long)
    outs = []
    for compiled in (step, None):
        draft.compiled = compiled
        cache = draft.new_cache(2, 40, torch.float32)
        with torch.inference_mode():
            outs.append(draft.step(hidden, wide[:, 1:2], Batch.make(0, pos, None, 40), cache, pick))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    batch = Batch.make(0, torch.tensor([[7]]), None, 40)
    tokens, pick = torch.tensor([[3]]), torch.zeros(1, dtype=torch.long)
    for other in (dense, int4_draft(Eagle3Draft(draft.cfg, target.model.embed_tokens).to(torch.bfloat16))):
        cache = other.new_cache(1, 40, other.dtype)
        x = torch.randn(1, 1, cfg.hidden_size).to(other.dtype)
        with torch.inference_mode():
            state = other.layer_state
            assert (
                step(
                    state,
                    x,
                    tokens,
                    batch.positions,
                    batch.write_positions,
                    batch.mask,
                    cache.k,
                    cache.v,
                    pick,
                )
                is None
            )


def test_loaded_packages_leave_nothing_in_tmp() -> None:
    """torch unpacks each package into a temporary folder it removes only at a clean exit (a killed
    node left 280 MB per set): the loader removes this process's folders once the libraries are
    mapped, and the layers still run."""
    import re

    from tide.models.llama import Batch

    target = tiny_target(seed=5, scale=2.0)
    target.weights = quantize_linears(target.model, "int4")
    assert target.compile() and target.draft_step.runners
    mapped = set(re.findall(r"(/\S*/aotinductor_[^/\s]+)/", Path("/proc/self/maps").read_text()))
    assert mapped, "no package library is mapped from a temporary folder"
    assert not [f for f in mapped if Path(f).exists()]
    batch = Batch.make(0, torch.tensor([[3]]), None, 8)
    ks, vs = target.model.new_cache(1, 8).rows(0, 1)
    x = torch.randn(1, 1, target.model.cfg.hidden_size)
    with torch.inference_mode():
        assert target.model.compiled is not None
        assert (
            target.model.compiled(x, batch.positions, batch.write_positions, batch.mask, ks, vs) is not None
        )


def test_a_damaged_compiled_package_is_built_again() -> None:
    """A package cut short or overwritten in the cache is compiled again on the next load, and the
    layers run compiled, not eagerly on every start."""
    from tide.config import cache_dir

    target = tiny_target(seed=5, scale=2.0)
    target.weights = quantize_linears(target.model, "int4")
    assert target.compile()
    (damaged,) = (cache_dir() / "compiled").glob(f"{package_key(target.model)}/rows1-tokens1.pt2")
    damaged.write_bytes(b"not a package")
    again = tiny_target(seed=5, scale=2.0)
    again.weights = quantize_linears(again.model, "int4")
    assert again.compile()
    assert damaged.stat().st_size > 1000


@pytest.mark.parametrize("failure", ["compiler", "disk"])
def test_a_failing_compile_leaves_the_layers_eager_and_nothing_in_the_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, failure: str
) -> None:
    """A package's compile that fails is a warning, not a crash: the target runs its eager layers and
    the cache keeps no exported or half-built file. Failing: the compile processes (no C++ compiler),
    or saving the second export (a full disk) while the first one's compile runs."""
    from tide.config import cache_dir
    from tide.models import aot

    monkeypatch.setenv("TIDE_CACHE", str(tmp_path))  # no package of this architecture yet
    monkeypatch.setattr(aot, "_workers", lambda: 4)  # every package's compile at once
    saved: list[Path] = []
    if failure == "compiler":
        monkeypatch.setenv("CXX", "/nonexistent/c++")  # what the compile processes inherit
    else:
        save = torch.export.save

        def full_disk(program: torch.export.ExportedProgram, f: Path) -> None:
            saved.append(f)
            if len(saved) > 1:
                Path(f).write_bytes(b"half an export")
                raise OSError(28, "No space left on device")
            save(program, f)

        monkeypatch.setattr(aot.torch.export, "save", full_disk)
    target = tiny_target(seed=7, scale=2.0)
    target.weights = quantize_linears(target.model, "int4")
    assert not target.compile() and target.model.compiled is None
    assert failure == "compiler" or len(saved) == 2  # it failed where meant to
    folder = cache_dir() / "compiled" / package_key(target.model)
    assert folder.is_dir() and not any(folder.iterdir())
    engine = Engine(target, None, EngineConfig(max_batch=1, max_model_len=64, gamma=0))
    [seq] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(seq.output) == 4


def test_a_draft_in_int4_keeps_its_dense_predictions() -> None:
    """`int4_draft` (how a node serves every draft) replaces each linear the kernel takes and leaves
    the rest dense (a head of 8 rows: its packing wants outputs in 16s); the step's logits stay
    close to the dense draft's, so acceptance moves little while a step reads a quarter of the bytes."""
    from tide.models.eagle3 import DraftConfig, Eagle3Draft
    from tide.models.llama import Batch

    target = tiny_target(seed=5, scale=2.0)
    cfg = target.model.cfg
    for vocab, head in ((64, Int4Linear), (8, torch.nn.Linear)):
        torch.manual_seed(vocab)
        dense = Eagle3Draft(DraftConfig.for_target(cfg, target.fingerprint, vocab), target.model.embed_tokens)
        draft = int4_draft(copy.deepcopy(dense))
        assert isinstance(draft.fc, Int4Linear) and isinstance(draft.midlayer.mlp.down_proj, Int4Linear)
        assert type(draft.lm_head) is head
        pos = torch.arange(6).unsqueeze(0)
        aux = torch.randn(1, 6, 3 * cfg.hidden_size)
        tokens = torch.randint(0, cfg.vocab_size, (1, 6))
        with torch.no_grad():
            out = [
                d.logits(d(d.fc(aux), tokens, Batch.make(0, pos, None, 8), d.new_cache(1, 8, torch.float32)))
                for d in (dense, draft)
            ]
        assert float((out[1] - out[0]).norm() / out[0].norm()) < 0.1


def test_compiling_the_draft_step_leaves_the_target_embedding_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node compiles in the background while it serves: export swaps traced tensors into the
    modules it traces, so the draft step is traced on an embedding of its own, never through the
    target's (which a request may be reading meanwhile)."""
    from tide.models.aot import CompiledDraftStep
    from tide.models.eagle3 import DraftConfig

    monkeypatch.setenv("TIDE_CACHE", str(tmp_path))  # nothing cached: every package is traced
    target = tiny_target(seed=5, scale=2.0)
    embed = target.model.embed_tokens
    weight = embed.weight
    calls: list[object] = []
    hook = embed.register_forward_hook(lambda m, args, out: calls.append(type(m.weight)))
    try:
        step = CompiledDraftStep()
        step.load(DraftConfig.for_target(target.config, target.fingerprint, 64), embed, target.model.dtype)
    finally:
        hook.remove()
    assert step.runners and len(step.runners) == 4
    assert calls == [] and embed.weight is weight
