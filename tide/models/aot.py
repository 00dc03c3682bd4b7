"""The target's decoder layers compiled ahead of time (AOTInductor, `torch.export`).

A forward pass is then one call into compiled C++: no Dynamo guard checks and no Python wrapper
between layers, which cost a quarter of a 4-bit decode step when the layers ran through
`torch.compile` (`docs/experiments.md`). Export specializes sizes of 1, so each shape class is a
package of its own: one row or more, one token or more (decode, verify and prefill at batch 1 and
above); keys and cache capacity are dynamic. A pass outside every class (a first token with no
keys before it, or a cache past `_LIMIT` positions) runs the same layers eagerly.

The weights are an input, as a draft step's are: packages are kept per architecture (the config,
each weight's name, dtype and shape) under `cache_dir()/compiled`, so a process holds one copy of
its weights and every target of an architecture and weight layout shares one compile (minutes the
first time, later loads under a second). A tensor every layer has alike is one input for all layers
(`_restack`): a call pays for each input. Each layer's cache rows are an input of their own, written
in place: a view into one cache for all layers would be copied whole on every call.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from tide.config import cache_dir
from tide.models.eagle3 import DraftConfig, Eagle3Draft
from tide.models.llama import Batch, DecoderStack, LlamaModel
from tide.models.weights import int4_draft

log = logging.getLogger(__name__)

Shape = tuple[bool, bool]  # (more than one row, more than one token)
Package = Callable[[list[torch.Tensor]], list[torch.Tensor]]  # flat tensors in, flat tensors out
SHAPES: tuple[Shape, ...] = ((False, False), (False, True), (True, False), (True, True))
_LIMIT = 1 << 16  # the largest batch, run length and cache capacity the packages take
# the code a package is compiled from
_STACK_SOURCES = ("llama.py", "weights.py", "aot.py")
_DRAFT_SOURCES = ("llama.py", "eagle3.py", "weights.py", "aot.py")
# where a draft step's int4 head holds its vocabulary (`weights.Int4Linear`): one package serves
# every draft vocabulary of a multiple of 16 (a head of another size stays dense, and eager)
_VOCAB_DIMS = {"lm_head.qweight": 0, "lm_head.scales_and_zeros": 1}


class CompiledStack:
    """`DecoderStack`'s call through the compiled packages; None where no package covers the shape.
    `weights`: the stack's tensors as the packages take them (`_restack`), in their input order."""

    def __init__(self, runners: dict[Shape, Package], weights: list[torch.Tensor]):
        self.runners, self.weights = runners, weights

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        write_positions: torch.Tensor,
        mask: torch.Tensor,
        ks: list[torch.Tensor],
        vs: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        run = _runner(self.runners, positions, mask, ks[0])
        if run is None:
            return None
        x, aux = run([*self.weights, x, positions, write_positions, mask, *ks, *vs])
        return x, aux


def _runner(
    runners: dict[Shape, Package], positions: torch.Tensor, mask: torch.Tensor, cache: torch.Tensor
) -> Package | None:
    """The package for a pass's shape class; None for a pass no package covers (a single key, or
    sizes past `_LIMIT`)."""
    b, t = positions.shape
    run = runners.get((b > 1, t > 1))
    if run is None or not 2 <= mask.shape[-1] < _LIMIT or cache.shape[2] > _LIMIT:
        return None
    return run


class CompiledDraftStep:
    """`DraftStep`'s call through the packages compiled for one draft architecture, empty until
    `load`; None where no package covers the shape or the draft is of another architecture. The
    draft's tensors are an input, so a new draft version runs compiled from its first step."""

    def __init__(self) -> None:
        self.arch: tuple[object, ...] = ()
        self.names: list[str] = []  # the state's tensors in the packages' input order
        self.runners: dict[Shape, Package] = {}
        self._checked: tuple[dict[str, torch.Tensor] | None, bool] = (None, False)  # last state seen

    def load(self, cfg: DraftConfig, embed: torch.nn.Embedding, dtype: torch.dtype) -> None:
        """Load the packages of this architecture in `dtype`, compiling the missing ones first:
        traced on an untrained draft, as the weights are an input (raises what the toolchain raises)."""
        # its own embedding of the same shape: export swaps traced tensors into the modules it
        # traces, and the target's embedding serves meanwhile (a node compiles in the background)
        private = torch.nn.Embedding.from_pretrained(torch.empty_like(embed.weight))
        template = int4_draft(Eagle3Draft(cfg, private).to(dtype).eval())  # as `DraftSet` serves it
        arch = draft_arch(dtype, template.layer_state)
        h = _code_hash(_DRAFT_SOURCES)
        h.update(repr((arch, cfg.rms_eps)).encode())  # the norms' epsilon is compiled in

        def export(shape: Shape) -> torch.export.ExportedProgram:
            return _export(_Stateless(template.layer), _draft_example(template, shape))

        runners = _packages(cache_dir() / "compiled" / f"draft-{h.hexdigest()[:20]}", export)
        self.arch, self.names = arch, list(template.layer_state)
        self.runners = runners  # last: a reader sees none or all

    def __call__(
        self,
        state: dict[str, torch.Tensor],
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_positions: torch.Tensor,
        mask: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pick: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        run = _runner(self.runners, positions, mask, k)
        if run is None:
            return None
        if self._checked[0] is not state:  # once per draft, not per call
            self._checked = (state, draft_arch(hidden.dtype, state) == self.arch)
        if not self._checked[1]:
            return None
        # a package reads its inputs with the strides it was traced with: a column of a wider
        # tensor is copied (never the cache rows k and v, which it writes in place)
        args = [
            hidden.contiguous(),
            tokens.contiguous(),
            positions,
            write_positions,
            mask,
            k,
            v,
            pick.contiguous(),
        ]
        out, logits = run([*(state[n] for n in self.names), *args])
        return out, logits


class _Stateless(torch.nn.Module):
    """A module's call with its tensors as an input (`torch.func.functional_call`). `stacked`: an
    input that holds one tensor per layer along its first dimension, and the names they stand for."""

    def __init__(self, module: torch.nn.Module, stacked: dict[str, list[str]] | None = None):
        super().__init__()
        self._module = [module]  # not a submodule: its tensors must not be baked into the package
        self.stacked = stacked or {}

    def forward(self, state: dict[str, torch.Tensor], args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        tensors: dict[str, torch.Tensor] = {}
        for key, t in state.items():
            names = self.stacked.get(key)
            tensors.update(zip(names, t.unbind(0), strict=True) if names else ((key, t),))
        return torch.func.functional_call(self._module[0], tensors, args)


def draft_arch(dtype: torch.dtype, state: dict[str, torch.Tensor]) -> tuple[object, ...]:
    """What a compiled draft step fits: the dtype, and each tensor's name, dtype and shape but the
    head's vocabulary size, which the packages take as dynamic."""

    def shape(name: str, t: torch.Tensor) -> tuple[int | None, ...]:
        dims: list[int | None] = list(t.shape)
        i = _VOCAB_DIMS.get(name)
        if i is not None and 16 <= t.shape[i] <= _LIMIT:  # the packages' range of it
            dims[i] = None
        return tuple(dims)

    return (dtype, *((k, t.dtype, shape(k, t)) for k, t in sorted(state.items())))


def package_key(model: LlamaModel) -> str:
    """What the stack's packages depend on: the config, each weight's name, dtype and shape, the
    layers' kinds, the code, torch and the CPU's kernels; not the weights' values (an input)."""
    h = _code_hash(_STACK_SOURCES)
    h.update(repr((model.cfg, str(model.stack))).encode())
    for name, t in stack_state(model.stack).items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
    return h.hexdigest()[:20]


def stack_state(stack: DecoderStack) -> dict[str, torch.Tensor]:
    """The tensors the stack reads, by name."""
    return {**dict(stack.named_parameters()), **dict(stack.named_buffers())}


def _restack(stack: DecoderStack) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """The packages' first inputs: each tensor every layer has alike (name, dtype, shape) as one
    tensor for all layers, stacked along a first dimension, and the rest by name; with the names
    each stacked input stands for. The layers' own tensors become views into the stacked ones, so
    the process keeps one copy. A package's call costs about 0.7 µs an input: the default model's
    300 tensors were 2–4% of a step, its 12 inputs are not (`docs/experiments.md`)."""
    state = stack_state(stack)
    kinds: dict[str, list[str]] = {}
    for name in state:
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m:
            kinds.setdefault(m[2], []).append(name)
    inputs, stacked = {}, {}
    for kind, names in kinds.items():
        ts = [state[n] for n in names]
        if len(ts) != len(stack.layers) or any(t.dtype != ts[0].dtype or t.shape != ts[0].shape for t in ts):
            continue
        key = f"layers.*.{kind}"
        inputs[key], stacked[key] = torch.stack([t.detach() for t in ts]), names
        for name, view, old in zip(names, inputs[key].unbind(0), ts, strict=True):
            path, _, leaf = name.rpartition(".")
            module = stack.get_submodule(path)
            if leaf in module._parameters:
                module._parameters[leaf] = torch.nn.Parameter(view, requires_grad=old.requires_grad)
            else:
                module._buffers[leaf] = view
    taken = {n for names in stacked.values() for n in names}
    inputs.update((n, t) for n, t in state.items() if n not in taken)
    return inputs, stacked


def _code_hash(sources: tuple[str, ...]) -> hashlib._Hash:
    h = hashlib.sha256()
    h.update(f"{torch.__version__}:{torch.backends.cpu.get_cpu_capability()}".encode())
    for name in sources:
        h.update((Path(__file__).parent / name).read_bytes())
    return h


def _dims(shape: Shape) -> tuple[object, object, object, object]:
    """Rows, tokens (None where the class fixes them to 1), keys and cache capacity."""
    many, tokens = shape
    dim = torch.export.Dim
    rows = dim("rows", min=2, max=_LIMIT) if many else None
    run = dim("tokens", min=2, max=_LIMIT) if tokens else None
    return rows, run, dim("keys", min=2, max=_LIMIT - 1), dim("capacity", min=4, max=_LIMIT)


def _only(sizes: dict[int, object]) -> dict[int, object]:
    return {i: d for i, d in sizes.items() if d is not None}


def _example_batch(shape: Shape, capacity: int) -> tuple[int, int, Batch]:
    b, t = (2 if shape[0] else 1), (3 if shape[1] else 1)
    positions = (5 + torch.arange(t)).repeat(b, 1)
    return b, t, Batch.make(0, positions, None, capacity)


def _example(model: LlamaModel, shape: Shape) -> tuple[tuple[object, ...], tuple[object, ...]]:
    """Arguments to trace the stack with, and which of their sizes are dynamic."""
    b, t, batch = _example_batch(shape, 32)
    ks, vs = model.new_cache(b, 32).rows(0, b)
    x = torch.zeros(b, t, model.cfg.hidden_size, dtype=model.dtype)
    rows, run, keys, cap = _dims(shape)
    layer = [_only({0: rows, 2: cap})] * model.cfg.num_layers
    dynamic = (_only({0: rows, 1: run}),) * 3 + (_only({0: rows, 2: run, 3: keys}), layer, layer)
    return (x, batch.positions, batch.write_positions, batch.mask, ks, vs), dynamic


def _draft_example(draft: Eagle3Draft, shape: Shape) -> tuple[tuple[object, ...], tuple[object, ...]]:
    """Inputs to trace a draft step with (its state, then `DraftStep`'s arguments), and their dynamic sizes."""
    b, t, batch = _example_batch(shape, 32)
    dtype = draft.dtype
    cache = draft.new_cache(b, 32, dtype)
    x = torch.zeros(b, t, draft.cfg.hidden_size, dtype=dtype)
    tokens = torch.zeros(b, t, dtype=torch.long)
    pick = torch.full((b,), t - 1)
    rows, run, keys, cap = _dims(shape)
    kv = _only({0: rows, 2: cap})
    args = (x, tokens, batch.positions, batch.write_positions, batch.mask, cache.k, cache.v, pick)
    dynamic = (*(_only({0: rows, 1: run}),) * 4, _only({0: rows, 2: run, 3: keys}), kv, kv, _only({0: rows}))
    state = draft.layer_state
    vocab = torch.export.Dim("vocab", min=16, max=_LIMIT)
    return (state, args), (
        {k: ({_VOCAB_DIMS[k]: vocab} if k in _VOCAB_DIMS else None) for k in state},
        dynamic,
    )


def _export(
    module: torch.nn.Module, example: tuple[tuple[object, ...], tuple[object, ...]]
) -> torch.export.ExportedProgram:
    args, dynamic = example
    with torch.no_grad():
        return torch.export.export(module, args, dynamic_shapes=dynamic, strict=False)


def _compile_apart(program: torch.export.ExportedProgram, path: Path) -> Callable[[bool], None]:
    """Start compiling `program` into `path` in a process of its own; returns the wait for it
    (`wait(False)` stops it instead). Half of a compile is the C++ compiler, the rest inductor's
    Python: processes, not threads, let the shape classes compile side by side (`docs/experiments.md`)."""
    stem = f"{path.stem}.{uuid.uuid4().hex}"  # unique across nodes sharing one cache volume
    exported, partial, errors = (
        path.with_name(f"{stem}.{end}") for end in ("export.pt2", "partial.pt2", "log")
    )
    try:
        torch.export.save(program, exported)
        # -P: the installed package, never a `tide` folder in the working directory
        cmd = [sys.executable, "-P", "-m", "tide.models.aot", str(os.getpid()), str(exported), str(partial)]
        with errors.open("wb") as err:  # a file, not a pipe: a chatty compiler never blocks on it
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    except BaseException:  # a full disk, say: nothing is left in the cache
        for f in (exported, errors):
            f.unlink(missing_ok=True)
        raise

    def wait(finish: bool = True) -> None:
        try:
            if finish:
                if proc.wait() != 0:
                    raise RuntimeError(
                        f"compiling {path.name} failed: {errors.read_text(errors='replace')[-2000:]}"
                    )
                os.replace(partial, path)  # whole or absent: another process may build the same package
        finally:  # stopped, failed or interrupted: a compile left running would write into the cache later
            proc.kill()  # nothing, once it has exited
            proc.wait()
            for f in (exported, partial, errors):
                f.unlink(missing_ok=True)

    return wait


def _workers() -> int:
    """Compile processes at once: the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _packages(folder: Path, export: Callable[[Shape], torch.export.ExportedProgram]) -> dict[Shape, Package]:
    """Load a package for each shape class from `folder`, building the missing or damaged ones:
    exported here one after another, each compiled in a process of its own, as many at once as
    there are cores."""
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    runners: dict[Shape, Package] = {}
    missing: list[tuple[Shape, Path]] = []
    for shape in SHAPES:
        path = folder / f"rows{'N' if shape[0] else '1'}-tokens{'N' if shape[1] else '1'}.pt2"
        if path.exists():
            try:
                runners[shape] = _load(path)
                continue
            except Exception as e:  # a damaged file: built again rather than eager on every start
                log.warning("compiled package %s unreadable (%s): compiling it again", path, e)
        missing.append((shape, path))
    waits: list[Callable[[bool], None]] = []
    try:
        for shape, path in missing:
            if len(waits) >= _workers():
                waits.pop(0)(True)
            waits.append(_compile_apart(export(shape), path))
        while waits:
            waits.pop(0)(True)
    finally:  # a failure: the compiles still running are stopped, and leave nothing
        for wait in waits:
            wait(False)
    for shape, path in missing:
        runners[shape] = _load(path)
    log.info("compiled ahead of time: %s (%.0f s)", folder.name, time.perf_counter() - start)
    return runners


def _load(path: Path) -> Package:
    """Load a package, to be called with its inputs flattened as export flattened them (torch's own
    call parses the call spec and flattens the arguments again on every call: 0.17 ms, a quarter of
    a compiled draft step). torch unpacks a package into a temporary folder it removes only at a clean
    exit; once the library is mapped the folder is not needed, so it goes now: a killed process
    leaves nothing."""
    run: Package = torch._inductor.aoti_load_package(str(path)).loader.boxed_run
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: left to torch
        return run
    for folder in set(re.findall(r"(/\S*/aotinductor_[^/\s]+)/", maps)):
        shutil.rmtree(folder, ignore_errors=True)
    return run


def compile_stack(model: LlamaModel) -> CompiledStack:
    """Load the model's packages, compiling the missing ones first (raises what the toolchain raises);
    the model's layer weights are laid out for them first (`_restack`)."""
    inputs, stacked = _restack(model.stack)

    def export(shape: Shape) -> torch.export.ExportedProgram:
        # a copy: export swaps a module's weights for traced ones while it runs, and a serving node
        # compiling in the background runs the model's own layers meanwhile
        args, dynamic = _example(model, shape)
        module = _Stateless(copy.deepcopy(model.stack), stacked)
        return _export(module, ((inputs, args), (dict.fromkeys(inputs), dynamic)))

    runners = _packages(cache_dir() / "compiled" / package_key(model), export)
    return CompiledStack(runners, list(inputs.values()))


def _compile_main(parent: str, exported: str, partial: str) -> None:
    """A compile process (`_compile_apart`): killed with the thread that started it, so a node
    killed while compiling leaves no compile running."""
    import ctypes
    import signal

    # not Linux: a compile whose node died runs on, and its package is unused
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):  # the parent died before the signal was asked for
        return
    torch._inductor.aoti_compile_and_package(torch.export.load(exported), package_path=partial)


if __name__ == "__main__":
    _compile_main(*sys.argv[1:4])
