"""The target's decoder layers compiled ahead of time (AOTInductor, `torch.export`).

A forward pass is then one call into compiled C++: no Dynamo guard checks and no Python wrapper
between layers, which cost a quarter of a 4-bit decode step when the layers ran through
`torch.compile` (`docs/experiments.md`). Export specializes sizes of 1, so each shape class is a
package of its own: one row or more, one token or more (decode, verify and prefill at batch 1 and
above); keys and cache capacity are dynamic. A pass outside every class (a first token with no
keys before it, or a cache past `_LIMIT` positions) runs the same layers eagerly.

The weights are compiled into the packages, so they are kept per weight content under
`cache_dir()/compiled`: the first compile of a target takes minutes, later loads under a second.
Each layer's cache rows are an input of their own, written in place: a view into one cache for all
layers would be copied whole on every call.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tide.config import cache_dir
from tide.models.llama import Batch, DecoderStack, LlamaModel

log = logging.getLogger(__name__)

Shape = tuple[bool, bool]  # (more than one row, more than one token)
SHAPES: tuple[Shape, ...] = ((False, False), (False, True), (True, False), (True, True))
_LIMIT = 1 << 16  # the largest batch, run length and cache capacity the packages take
_SOURCES = ("llama.py", "weights.py", "aot.py")  # the code a package is compiled from


class CompiledStack:
    """`DecoderStack`'s call through the compiled packages; None where no package covers the shape."""

    def __init__(self, runners: dict[Shape, Callable[..., list[torch.Tensor]]]):
        self.runners = runners

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        write_positions: torch.Tensor,
        mask: torch.Tensor,
        ks: list[torch.Tensor],
        vs: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        b, t = positions.shape
        run = self.runners.get((b > 1, t > 1))
        if run is None or not 2 <= mask.shape[-1] < _LIMIT or ks[0].shape[2] > _LIMIT:
            return None
        x, aux = run(x, positions, write_positions, mask, ks, vs)
        return x, aux


def package_key(stack: DecoderStack) -> str:
    """What a package depends on: the weights' bytes and dtypes, the code, torch and the CPU's kernels."""
    h = hashlib.sha256()
    h.update(f"{torch.__version__}:{torch.backends.cpu.get_cpu_capability()}".encode())
    for name in _SOURCES:
        h.update((Path(__file__).parent / name).read_bytes())
    for name, t in sorted(stack.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:20]


def _example(model: LlamaModel, shape: Shape) -> tuple[tuple[object, ...], tuple[object, ...]]:
    """Inputs to trace with, and which of their sizes are dynamic."""
    many, tokens = shape
    b, t, capacity = (2 if many else 1), (3 if tokens else 1), 32
    cache = model.new_cache(b, capacity)
    positions = (5 + torch.arange(t)).repeat(b, 1)
    batch = Batch.make(0, positions, None, capacity)
    x = torch.zeros(b, t, model.cfg.hidden_size, dtype=model.dtype)
    ks, vs = cache.rows(0, b)
    args = (x, positions, batch.write_positions, batch.mask, ks, vs)
    dim = torch.export.Dim
    rows = dim("rows", min=2, max=_LIMIT) if many else None
    run = dim("tokens", min=2, max=_LIMIT) if tokens else None
    keys, cap = dim("keys", min=2, max=_LIMIT - 1), dim("capacity", min=4, max=_LIMIT)

    def only(sizes: dict[int, object]) -> dict[int, object]:
        return {i: d for i, d in sizes.items() if d is not None}

    layer = [only({0: rows, 2: cap})] * model.cfg.num_layers
    dynamic = (only({0: rows, 1: run}),) * 3 + (only({0: rows, 2: run, 3: keys}), layer, layer)
    return args, dynamic


def _build(model: LlamaModel, shape: Shape, path: Path) -> None:
    args, dynamic = _example(model, shape)
    with torch.no_grad():
        # a copy: export swaps a module's weights for traced ones while it runs, and a serving node
        # compiling in the background runs the model's own layers meanwhile
        stack = copy.deepcopy(model.stack)
        program = torch.export.export(stack, args, dynamic_shapes=dynamic, strict=False)
        partial = path.with_suffix(f".{os.getpid()}.partial.pt2")
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
    os.replace(partial, path)  # whole or absent: another process may be building the same package


def compile_stack(model: LlamaModel) -> CompiledStack:
    """Load the model's packages, compiling the missing ones first (raises what the toolchain raises)."""
    folder = cache_dir() / "compiled" / package_key(model.stack)
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    runners: dict[Shape, Callable[..., list[torch.Tensor]]] = {}
    for shape in SHAPES:
        path = folder / f"rows{'N' if shape[0] else '1'}-tokens{'N' if shape[1] else '1'}.pt2"
        if path.exists():
            try:
                runners[shape] = torch._inductor.aoti_load_package(str(path))
                continue
            except Exception as e:  # a damaged file: built again rather than eager on every start
                log.warning("compiled package %s unreadable (%s): compiling it again", path, e)
        _build(model, shape, path)
        runners[shape] = torch._inductor.aoti_load_package(str(path))
    log.info("decoder layers compiled ahead of time: %s (%.0f s)", folder.name, time.perf_counter() - start)
    return CompiledStack(runners)
