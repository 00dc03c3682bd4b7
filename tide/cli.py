"""The `tide` command."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
import typer

from tide.config import (
    DTYPE_HELP,
    bound_kernel_cache,
    default_draft_dir,
    give_freed_tensors_back,
    parse_dtype,
)
from tide.models.loader import Target
from tide.models.weights import WEIGHT_MODES, WEIGHTS_HELP
from tide.producers.records import DEFAULT_CODEC
from tide.prompts import WORKLOADS, Prompt

PROPOSER_HELP = (
    "draft: the learned draft; suffix: continue the workload's recent text (no draft needed); hybrid: "
    "per sequence and step, whichever is expected to add more tokens"
)

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="TIDE: self-improving speculative LLM serving."
)
draft_app = typer.Typer(no_args_is_help=True, help="Draft models: train, inspect.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks, side by side in one run.")
app.callback()(give_freed_tensors_back)  # every tide process: the long-running parts above all
app.add_typer(draft_app, name="draft")
app.add_typer(bench_app, name="bench")

DEFAULT_WORKLOADS = ("chat_en", "code", "math", "chat_fr")


@contextlib.contextmanager
def _clear_errors() -> Iterator[None]:
    """Bad input (a prompt file, a model, a draft) ends the command with its reason, not a traceback."""
    from tide.models.eagle3 import DraftLoadError, DraftMismatchError
    from tide.models.loader import ModelLoadError
    from tide.models.weights import GGUFBlockError
    from tide.prompts import PromptFileError

    try:
        yield
    except (
        PromptFileError,
        ModelLoadError,
        GGUFBlockError,
        DraftLoadError,
        DraftMismatchError,
        OSError,
    ) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


DRAFT_WEIGHTS_HELP = (
    "the target's weights while it answers the prompts: the draft learns the hidden states of the mode "
    "that will serve it (default auto, as `tide serve`)"
)
COMPILE_HELP = "compile the target's decoder layers ahead of time (quantized weights; once per architecture, then cached)"


def _weights(name: str) -> str:
    if name not in WEIGHT_MODES:
        raise typer.BadParameter(f"one of {', '.join(WEIGHT_MODES)}", param_hint="--weights")
    return name


def _dtype(name: str) -> torch.dtype:
    try:
        return parse_dtype(name)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--dtype") from None


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


@draft_app.command("train")
def draft_train(
    prompts: list[Path] = typer.Option(
        ..., "--prompts", help="JSONL prompt file(s); repeat the option for several"
    ),
    out: Path = typer.Option(..., "--out", help="draft folder to write"),
    budget_minutes: float = typer.Option(
        10.0, "--budget-minutes", help="wall-clock budget: generating data + training"
    ),
    part: str = typer.Option(
        "all", "--part", help="train (first 80%), test (last 20%) or all lines of each file"
    ),
    model: str | None = typer.Option(
        None, "--model", help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)"
    ),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    draft_vocab: int = typer.Option(4096, "--draft-vocab"),
    limit: int = typer.Option(0, "--limit", help="use at most this many prompts per file (0: all)"),
    data: Path | None = typer.Option(
        None, "--data", help="save the collected hidden states here, or reuse them if present"
    ),
    max_steps: int = typer.Option(
        0, "--max-steps", help="stop after this many training steps (0: train until the budget is spent)"
    ),
    weights: str = typer.Option("auto", "--weights", help=DRAFT_WEIGHTS_HELP),
) -> None:
    """The target answers the prompts, the tap captures hidden states, and an EAGLE-3 head is trained."""
    from tide.bootstrap import BootstrapConfig, bootstrap
    from tide.models.loader import load_target
    from tide.prompts import load_prompts, split

    mode = _weights(weights)
    with _clear_errors():
        items = []
        for f in prompts:
            chosen = split(load_prompts(f), part)
            items += chosen[:limit] if limit else chosen
        target = load_target(model, weights=mode)
    cfg = BootstrapConfig(
        budget_minutes=budget_minutes,
        max_new_tokens=max_new_tokens,
        draft_vocab_size=draft_vocab,
        max_steps=max_steps,
    )
    report = bootstrap(target, _interleave(items, len(prompts)), out, cfg, data)
    last = report["history"][-1] if report["history"] else {}
    typer.echo(
        json.dumps(
            {"out": str(out), "examples": report["examples"], "tokens": report["tokens"], "final_eval": last},
            indent=2,
        )
    )


def _interleave(items: list[Prompt], files: int) -> list[Prompt]:
    """Mix prompt files so a budget cut still sees every workload."""
    if files <= 1:
        return items
    import random

    mixed = items[:]
    random.Random(0).shuffle(mixed)
    return mixed


@draft_app.command("ensure-default")
def draft_ensure_default(
    budget_minutes: float = typer.Option(12.0, "--budget-minutes"),
    model: str | None = typer.Option(None, "--model"),
    register: str | None = typer.Option(
        None,
        "--register",
        help="MLflow tracking URI: make it the `default` workload's champion, unless one is",
    ),
    weights: str = typer.Option("auto", "--weights", help=DRAFT_WEIGHTS_HELP),
) -> None:
    """Train the default draft from the shipped workloads once; later calls find it cached."""
    from tide.models.loader import load_target

    with _clear_errors():
        target = load_target(model, weights=_weights(weights))
    out = default_draft_dir(target.fingerprint)
    if (out / "model.safetensors").exists():
        typer.echo(f"default draft present: {out}")
    else:
        _train_default_draft(target, out, budget_minutes)
    if register:
        from mlflow import MlflowClient

        from tide.registry.store import ensure_champion
        from tide.registry.tags import source_tags

        mv = ensure_champion(
            MlflowClient(register), target.fingerprint, "default", out, source_tags("the default draft")
        )
        typer.echo(
            f"champion of `default`: version {mv.version}" if mv else "`default` already has a champion"
        )


def _train_default_draft(target: Target, out: Path, budget_minutes: float) -> None:
    from tide.bootstrap import BootstrapConfig, bootstrap
    from tide.prompts import load_prompts, split

    items = []
    for name in DEFAULT_WORKLOADS:
        items += split(load_prompts(WORKLOADS / f"{name}.jsonl"), "train")
    tmp = out.with_name(out.name + ".partial")
    bootstrap(
        target,
        _interleave(items, len(DEFAULT_WORKLOADS)),
        tmp,
        BootstrapConfig(budget_minutes=budget_minutes),
    )
    tmp.rename(out)
    typer.echo(f"default draft trained: {out}")


@app.command("train")
def train_online(
    kafka: str = typer.Option(..., "--kafka", help="bootstrap servers of the broker holding the records"),
    workload: str = typer.Option(..., "--workload"),
    mlflow: str | None = typer.Option(
        None, "--mlflow", help="tracking URI: runs and candidate versions go there"
    ),
    model: str | None = typer.Option(
        None, "--model", help="the target (only its embedding and LM head are read)"
    ),
    start_draft: Path | None = typer.Option(
        None, "--start-draft", help="default: the workload's champion in MLflow, else the default draft"
    ),
    state_dir: Path | None = typer.Option(None, "--state-dir", help="checkpoints (default: under the cache)"),
    max_steps: int = typer.Option(0, "--max-steps", help="stop after this many steps (0: run until stopped)"),
    idle_seconds: float = typer.Option(
        0,
        "--idle-seconds",
        help="stop after this long without new records, counted once it has its partitions (0: never)",
    ),
    eval_every: int = typer.Option(50, "--eval-every"),
    checkpoint_every: int = typer.Option(50, "--checkpoint-every"),
    publish_every: int = typer.Option(500, "--publish-every"),
    vocab_warmup: int = typer.Option(
        2048, "--vocab-warmup", help="positions read before the vocabulary refit"
    ),
    replay_when_idle: bool = typer.Option(
        True,
        "--replay-when-idle/--no-replay-when-idle",
        help="train on the replay buffer while no record comes",
    ),
    codec: str = typer.Option(
        DEFAULT_CODEC, "--codec", help="record codec the replay buffer and checkpoints keep states in"
    ),
    topic_keep_minutes: float = typer.Option(
        30.0, "--topic-keep-minutes", help="the topic is sized to keep this much of its traffic (0: as made)"
    ),
    seed: int = typer.Option(0, "--seed", help="seeds which examples each step samples"),
    verbose: bool = typer.Option(False, "--verbose"),
) -> None:
    """Train a workload's draft from its Kafka topic; publish candidates to MLflow."""
    bound_kernel_cache()
    import random
    import signal
    import threading
    from dataclasses import asdict

    from tide.config import cache_dir
    from tide.models.loader import load_head
    from tide.producers.records import CODECS
    from tide.producers.topics import TopicSizing
    from tide.registry.trainer_sink import MlflowSink, champion_folder
    from tide.serving.capture import check_workload
    from tide.trainers.online import OnlineConfig, OnlineTrainer
    from tide.trainers.reader import WorkloadTaken

    _setup_logging(verbose)
    try:
        check_workload(workload)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--workload") from None
    if codec not in CODECS:
        raise typer.BadParameter(f"choose one of {', '.join(CODECS)}", param_hint="--codec")
    random.seed(seed)
    torch.manual_seed(seed)
    with _clear_errors():
        head = load_head(model)
        state = state_dir or cache_dir() / "trainers" / head.fingerprint[:12] / workload
        cfg = OnlineConfig(
            kafka, workload, state, eval_every=eval_every, checkpoint_every=checkpoint_every,
            publish_every=publish_every, vocab_warmup_positions=vocab_warmup, replay_when_idle=replay_when_idle,
            codec=codec, topic_sizing=TopicSizing(topic_keep_minutes * 60) if topic_keep_minutes > 0 else None,
        )  # fmt: skip
        sink = None
        if mlflow:
            params = {k: v for k, v in asdict(cfg).items() if k != "train"}
            sink = MlflowSink(mlflow, workload, head.fingerprint, params)
        # the draft serving the workload now: its champion, else the default workload's, else the default draft
        start = (
            start_draft
            or (champion_folder(sink.client, head.fingerprint, workload, state) if sink else None)
            or (champion_folder(sink.client, head.fingerprint, "default", state) if sink else None)
            or default_draft_dir(head.fingerprint)
        )
        if not (start / "model.safetensors").exists():
            raise typer.BadParameter(
                f"no draft at {start}: run `tide draft ensure-default`", param_hint="--start-draft"
            )
        try:
            trainer = OnlineTrainer(cfg, head, start, sink, sink.log_step if sink else None)
        except WorkloadTaken as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        # SIGTERM (`tide up` stopping, a pod's end) finishes the step and checkpoints what was read
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            ledger = trainer.run(max_steps or None, idle_seconds or None, stop)
        finally:
            trainer.close()
            if sink is not None:
                sink.close()
    typer.echo(json.dumps({"steps": ledger.steps, "records": ledger.records, "redeliveries": ledger.redeliveries,
                           "skipped": ledger.skipped, "candidates": ledger.candidates, "best_tau": ledger.best_tau}))  # fmt: skip


@app.command("serve")
def serve(
    model: str | None = typer.Option(
        None, "--model", help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)"
    ),
    draft: str | None = typer.Option(
        None, "--draft", help="draft folder (default: the cached default draft, if any)"
    ),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
    weights: str = typer.Option("auto", "--weights", help=WEIGHTS_HELP),
    compile: bool = typer.Option(True, "--compile/--no-compile", help=COMPILE_HELP),
    gamma: str = typer.Option(
        "4", "--gamma", help="draft tokens per step (0: no speculation), or 'auto': the controller chooses"
    ),
    max_batch: int = typer.Option(16, "--max-batch"),
    max_model_len: int = typer.Option(2048, "--max-model-len"),
    max_queue: int = typer.Option(64, "--max-queue", help="requests waiting for a slot; more get 429"),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes"),
    admin_token: str | None = typer.Option(
        None, "--admin-token", envvar="TIDE_ADMIN_TOKEN", help="bearer token of /admin (unset: admin off)"
    ),
    kafka: str | None = typer.Option(
        None, "--kafka", help="bootstrap servers: publish captured hidden states there (unset: no capture)"
    ),
    codec: str = typer.Option(
        DEFAULT_CODEC, "--codec", help="record codec: bf16, int8-g64, fp8-g64 or int4-g32"
    ),
    chunk_positions: int = typer.Option(128, "--chunk-positions", help="positions per Kafka record at most"),
    capture: str = typer.Option(
        "*=on", "--capture", help="capture rules, e.g. 'code=on,chat=0.25,*=off' (also at /admin/capture)"
    ),
    registry: str | None = typer.Option(
        None, "--registry", help="MLflow tracking URI: follow each workload's champion draft (unset: no)"
    ),
    registry_poll: float = typer.Option(10.0, "--registry-poll", help="seconds between champion polls"),
    workloads: str = typer.Option(
        "",
        "--workloads",
        help="the workloads this node serves, e.g. 'code,fr'; other names are served as 'default' "
        "(with --registry: followed from the start). Unset: the first --max-workloads names seen",
    ),
    max_workloads: int = typer.Option(
        16, "--max-workloads", min=0, help="without --workloads: names past this many are served as 'default'"
    ),
    node: str | None = typer.Option(
        None, "--node", envvar="TIDE_NODE", help="this node's name in registry tags (default: host:port)"
    ),
    rollback_tolerance: float = typer.Option(
        0.25,
        "--rollback-tolerance",
        min=0.0,
        max=1.0,
        help="live tau may fall this fraction below the gate's prediction",
    ),
    rollback_steps: int = typer.Option(
        1000, "--rollback-steps", min=1, help="sequence steps before a new draft is judged"
    ),
    min_gain: float = typer.Option(
        1.02,
        "--min-gain",
        min=1.0,
        help="with --gamma auto: speculate only where the predicted speedup reaches this; below it a "
        "workload's draft does not pay, and `auto` capture calls for training",
    ),
    engine: str = typer.Option(
        "tide",
        "--engine",
        help="tide, or vllm: vLLM's OpenAI server with the draft and the tap (`make vllm`)",
    ),
    proposer: str = typer.Option("draft", "--proposer", help=PROPOSER_HELP),
    suffix_feed: bool = typer.Option(
        False,
        "--suffix-feed",
        help="with --kafka and a suffix or hybrid proposer: index every node's captured requests, read "
        "off the workload topics, beside this node's own",
    ),
    verbose: bool = typer.Option(False, "--verbose"),
) -> None:
    """OpenAI-compatible HTTP server over the speculative engine."""
    import uvicorn

    from tide.producers.publisher import PublisherConfig
    from tide.producers.records import CODECS
    from tide.serving.api import ServerConfig, build_app
    from tide.serving.capture import CapturePolicy, WorkloadSet, parse_rules
    from tide.serving.controller import ControllerConfig
    from tide.serving.node import NodeConfig

    if codec not in CODECS:
        raise typer.BadParameter(f"choose one of {', '.join(CODECS)}", param_hint="--codec")
    try:
        names = [w.strip() for w in workloads.split(",") if w.strip()]
        served = WorkloadSet(names or None, max_workloads)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--workloads") from None
    try:
        policy = CapturePolicy(parse_rules(capture), workloads=served)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--capture") from None
    from tide.serving.engine import EngineConfig

    _check_proposer(proposer)
    if suffix_feed and (not kafka or proposer == "draft"):
        raise typer.BadParameter("needs --kafka and --proposer suffix or hybrid", param_hint="--suffix-feed")
    if engine == "vllm":
        if proposer != "draft":
            raise typer.BadParameter("a vLLM node drafts with the draft only", param_hint="--proposer")
        if len(names) > 1 and registry:
            raise typer.BadParameter("vLLM runs one drafter: name the one workload whose champion it "
                                     "follows", param_hint="--workloads")  # fmt: skip
        to_follow = (registry, node or _node_name(port), names[0] if names else "default", registry_poll,
                     rollback_tolerance, rollback_steps) if registry else None  # fmt: skip
        _serve_vllm(model, draft, host, port, dtype, gamma, max_batch, max_model_len, kafka, codec, capture,
                    chunk_positions, workloads, max_workloads, to_follow)  # fmt: skip
        return
    if engine != "tide":
        raise typer.BadParameter("tide or vllm", param_hint="--engine")
    adaptive = gamma == "auto"
    try:
        fixed_gamma = 0 if adaptive else int(gamma)
    except ValueError:
        raise typer.BadParameter("a number of draft tokens, or 'auto'", param_hint="--gamma") from None
    max_gamma = 6 if adaptive else max(8, fixed_gamma)
    sync = None
    if registry:
        from tide.config import cache_dir
        from tide.serving.capture import check_workload
        from tide.serving.draft_sync import SyncConfig

        try:
            follow = tuple(check_workload(w.strip()) for w in workloads.split(",") if w.strip())
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--workloads") from None
        sync = SyncConfig(
            registry, cache_dir() / "registry", node or _node_name(port), registry_poll,
            follow, rollback_tolerance, rollback_steps,
        )  # fmt: skip
    _setup_logging(verbose)
    with _clear_errors():
        api = build_app(
            model,
            draft,
            _dtype(dtype),
            NodeConfig(
                EngineConfig(
                    max_batch=max_batch,
                    max_model_len=max_model_len,
                    gamma=fixed_gamma,
                    max_gamma=max_gamma,
                    proposer=proposer,
                ),
                PublisherConfig(kafka, codec, chunk_positions) if kafka else None,
                sync,
                ControllerConfig(max_gamma=max_gamma, min_gain=min_gain) if adaptive else None,
                suffix_feed=suffix_feed,
            ),
            ServerConfig(
                admin_token=admin_token, max_queue=max_queue, max_body_bytes=max_body_bytes, capture=policy
            ),
            _weights(weights),
            compile,
        )
    uvicorn.run(api, host=host, port=port, log_level="info")


def _check_proposer(proposer: str) -> None:
    from tide.serving.engine import PROPOSERS

    if proposer not in PROPOSERS:
        raise typer.BadParameter(f"one of {', '.join(PROPOSERS)}", param_hint="--proposer")


def _node_name(port: int) -> str:
    import socket

    return f"{socket.gethostname()}:{port}"


def _serve_vllm(
    model: str | None, draft: str | None, host: str, port: int, dtype: str, gamma: str, max_batch: int,
    max_model_len: int, kafka: str | None, codec: str, capture: str, chunk_positions: int, workloads: str,
    max_workloads: int, follow: tuple[str, str, str, float, float, int] | None,
) -> None:  # fmt: skip
    """`tide serve --engine vllm`: vLLM's OpenAI server on the target's HF folder and the draft
    (exported for vLLM), capturing into Kafka with `--kafka`, following the registry with
    `--registry` (`follow`: its URI, the node's name, the workload, the poll and rollback settings)."""
    import tempfile

    from tide.config import cache_dir
    from tide.models.eagle3 import read_config
    from tide.models.hf_folder import write_hf_folder
    from tide.serving.vllm_adapter.config import FollowConfig, TapConfig, VllmConfig, VllmUnavailable
    from tide.serving.vllm_adapter.server import run_server
    from tide.trainers.export import export_speculators

    if not gamma.isdigit():
        raise typer.BadParameter("vLLM drafts a fixed number of tokens: give a number", param_hint="--gamma")
    with _clear_errors():
        folder, fp = write_hf_folder(model)
        source = Path(draft) if draft else default_draft_dir(fp)
        with tempfile.TemporaryDirectory(prefix="tide-vllm-draft-") as work:
            spec = None
            if int(gamma) > 0:
                if not (source / "config.json").exists():
                    raise typer.BadParameter(f"no draft at {source}", param_hint="--draft")
                spec = export_speculators(source, Path(work) / "draft", verifier_name_or_path=str(folder),
                                          speculative_tokens=int(gamma))  # fmt: skip
            tap = (
                TapConfig(kafka, fp, capture, codec, workloads, max_workloads, chunk_positions)
                if kafka
                else None
            )
            following = None
            if follow is not None:
                if spec is None:
                    raise typer.BadParameter("a vLLM node following the registry needs a draft to start with",
                                             param_hint="--gamma")  # fmt: skip
                uri, name, workload, poll, tolerance, steps = follow
                following = FollowConfig(uri, name, fp, str(cache_dir() / "registry"), workload, poll, tolerance,
                                         steps)  # fmt: skip
            native = str(_dtype(dtype)).removeprefix("torch.")
            cfg = VllmConfig(folder, spec, max(1, int(gamma)), native, max_model_len, max_batch,
                             torch.get_num_threads(), tap=tap, follow=following,
                             draft_version=read_config(source).version if spec is not None else "")  # fmt: skip
            try:
                code = run_server(cfg, host, port)
            except (VllmUnavailable, ValueError) as e:
                raise typer.BadParameter(str(e), param_hint="--engine") from None
    raise typer.Exit(code)


@app.command("gate")
def gate(
    mlflow: str = typer.Option(..., "--mlflow", help="tracking URI of the registry"),
    kafka: str = typer.Option(..., "--kafka", help="bootstrap servers: held-out records come from there"),
    model: str | None = typer.Option(
        None, "--model", help="the target (only its embedding and LM head are read)"
    ),
    once: bool = typer.Option(False, "--once", help="one pass over every workload, then exit"),
    poll_seconds: float = typer.Option(10.0, "--poll-seconds"),
    margin: float = typer.Option(
        0.02, "--margin", help="fraction by which a candidate must beat the baseline"
    ),
    confidence: float = typer.Option(
        1.0,
        "--confidence",
        min=0.0,
        help="standard errors the candidate's tau gain must stand above zero (held-out examples paired)",
    ),
    min_speedup: float = typer.Option(1.0, "--min-speedup", help="predicted speedup a candidate must reach"),
    min_tau: float = typer.Option(
        1.2, "--min-tau", help="tokens per step to reach while no profile is known"
    ),
    gamma: int = typer.Option(4, "--gamma", help="the serving gamma, used while no profile is known"),
    min_positions: int = typer.Option(256, "--min-positions", help="held-out positions needed to decide"),
    held_out_seconds: float = typer.Option(
        120.0, "--held-out-seconds", min=1.0, help="judge on the held-out records of this many last seconds"
    ),
    verbose: bool = typer.Option(False, "--verbose"),
) -> None:
    """The acceptance gate: promote a candidate to `champion` only if it beats what serves now."""
    bound_kernel_cache()
    from tide.config import cache_dir
    from tide.models.loader import load_head
    from tide.producers.records import HeldOutWindow
    from tide.registry.gate import Gate, GateConfig

    _setup_logging(verbose)
    with _clear_errors():
        head = load_head(model)
        cfg = GateConfig(
            mlflow, kafka, cache_dir() / "gate", margin=margin, confidence=confidence, min_speedup=min_speedup, min_tau=min_tau,
            gamma=gamma, gamma_max=max(4, gamma), held_out=HeldOutWindow(held_out_seconds, min_positions=min_positions),
        )  # fmt: skip
        g = Gate(cfg, head)
        try:
            if once:
                for d in g.run_once():
                    typer.echo(json.dumps({"model": d.name, "version": d.version, "decision": d.decision,
                                           "reason": d.reason}))  # fmt: skip
            else:
                g.run(poll_seconds)
        except KeyboardInterrupt:
            pass
        finally:
            g.close()


@app.command("up")
def up(
    data: Path | None = typer.Option(None, "--data", help="state, logs and data (default: <cache>/stack)"),
    host: str = typer.Option(
        "127.0.0.1",
        "--host",
        help="where every part listens: serving, MLflow, Kafka, S3 (0.0.0.0: everywhere)",
    ),
    port: int = typer.Option(8000, "--port", help="the HTTP endpoint"),
    mlflow_port: int = typer.Option(5000, "--mlflow-port", help="the MLflow UI"),
    workloads: str = typer.Option(
        "default",
        "--workloads",
        help="one trainer per workload, e.g. 'default,code'; the node serves other names as 'default'",
    ),
    s3: bool = typer.Option(False, "--s3", help="MLflow artifacts in a local S3 server (versitygw)"),
    draft: Path | None = typer.Option(
        None, "--draft", help="start from this draft (default: the default draft)"
    ),
    model: str | None = typer.Option(None, "--model"),
    serve_args: str = typer.Option(
        "", "--serve-args", help="more `tide serve` flags, e.g. '--gamma 3' (a flag given again wins)"
    ),
    train_args: str = typer.Option("", "--train-args", help="more `tide train` flags for every trainer"),
    gate_args: str = typer.Option("", "--gate-args", help="more `tide gate` flags"),
    draft_args: str = typer.Option(
        "", "--draft-args", help="more `tide draft ensure-default` flags (the first run's draft job)"
    ),
    engine: str = typer.Option(
        "tide", "--engine", help="the serving node's engine: tide, or vllm (one workload; needs a draft)"
    ),
) -> None:
    """The whole loop on this machine: Kafka, MLflow, trainers, the gate and a serving node. Ctrl-C stops it."""
    import shlex
    import signal
    import time

    from tqdm import tqdm

    from tide.config import cache_dir
    from tide.serving.capture import check_workload
    from tide.stack import Stack, StackConfig, StackError

    names = [w.strip() for w in workloads.split(",") if w.strip()]
    for w in names:
        try:
            check_workload(w)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--workloads") from None
    if engine not in ("tide", "vllm"):
        raise typer.BadParameter("tide or vllm", param_hint="--engine")
    if engine == "vllm" and len(names) != 1:
        raise typer.BadParameter("vLLM runs one drafter: name one workload", param_hint="--workloads")
    extra: dict[str, list[str]] = {}
    for part, flags, hint in (("serve", serve_args, "--serve-args"), ("train", train_args, "--train-args"),
                              ("gate", gate_args, "--gate-args"), ("draft", draft_args, "--draft-args")):  # fmt: skip
        try:
            extra[part] = shlex.split(flags)
        except ValueError as e:  # an unclosed quote
            raise typer.BadParameter(f"{e}: {flags!r}", param_hint=hint) from None
    cfg = StackConfig(
        data or cache_dir() / "stack", host, port, mlflow_port, names, s3, draft, model, extra, engine
    )
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(cfg)

    def interrupt(*_: object) -> None:  # a supervisor's SIGTERM unwinds like Ctrl-C: every part is stopped
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    # and Ctrl-C even when started with SIGINT ignored (a background job of a shell, nohup): Python
    # then installs no handler of its own, and `tide up` went on serving until it was killed
    signal.signal(signal.SIGINT, interrupt)
    try:
        with tqdm(stack.steps(), desc="tide up", unit="part") as bar:
            for step in bar:
                bar.set_postfix_str(f"starting {step}")
                stack.start_step(step)
        typer.echo(f"HTTP endpoint: {stack.endpoint}/v1  (OpenAI-compatible, model 'tide')")
        typer.echo(f"MLflow UI:     {stack.registry}")
        typer.echo(
            f"logs:          {cfg.data_dir / 'logs'}   (`tide status` shows each part; Ctrl-C stops them all)"
        )
        if not stack.has_champion:
            typer.echo("no draft yet: serving without speculation while the default draft trains (first time: "
                       "~12 min); it arrives through the registry, and the trainers start from it")  # fmt: skip
        while True:  # what dies starts again: a lost part degrades the loop, it never stops serving
            for name in stack.finish_jobs():
                typer.echo(f"{name} started: the first draft is ready")
            for name in stack.revive():
                typer.echo(f"{name} had stopped: started again", err=True)
            time.sleep(1.0)
    except KeyboardInterrupt:
        typer.echo("stopping")
    except StackError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    finally:
        stack.stop()


@app.command("secrets")
def secrets_cmd(
    data: Path | None = typer.Option(
        None, "--data", help="the `tide up` data folder (default: <cache>/stack)"
    ),
    k8s: Path | None = typer.Option(
        None, "--k8s", help="also write the k8s base's Secret env files here (infra/k8s/base/secrets)"
    ),
) -> None:
    """The stack's credentials (random, made once, 0600): prints the file for `docker compose --env-file`."""
    from tide.config import cache_dir
    from tide.stack import StackSecrets, secrets_path

    path = secrets_path(data or cache_dir() / "stack")
    made = StackSecrets.load_or_create(path)
    if k8s is not None:
        made.write_k8s(k8s)
    typer.echo(str(path))


@app.command("status")
def status_cmd(
    data: Path | None = typer.Option(
        None, "--data", help="the `tide up` data folder (default: <cache>/stack)"
    ),
) -> None:
    """Each part of a `tide up` stack: health, consumer lag, the champion per workload."""
    from tide.config import cache_dir
    from tide.stack import status

    state = (data or cache_dir() / "stack") / "stack.json"
    if not state.exists():
        typer.echo(f"error: no stack at {state.parent}: start one with `tide up`", err=True)
        raise typer.Exit(2)
    try:
        rows = status(state)
    except (ValueError, KeyError) as e:  # a stack.json that is not ours, or cut short
        typer.echo(f"error: unreadable {state}: {e!r}", err=True)
        raise typer.Exit(2) from None
    width = max(len(r["part"]) for r in rows)
    for r in rows:
        typer.echo(f"{r['part']:<{width}}  {r['state']:<4}  {r['detail']}")
    if any(r["state"] == "down" for r in rows):
        raise typer.Exit(1)


@app.command("plan")
def plan_cmd(
    cluster_file: Path = typer.Option(..., "--cluster", help="GPU classes, their rates, the training demand"),
    speedup: list[float] = typer.Option(
        [], "--speedup", help="speculative speedup s the drafts reach (repeatable; default: the file's)"
    ),
    out: Path = typer.Option(Path("out/placement.yaml"), "--out", help="the placement per s"),
    report: Path | None = typer.Option(None, "--report", help="JSON: placements and the shift replay"),
    plot: Path | None = typer.Option(None, "--plot", help="PNG: the shift replay at the first s"),
    shift_at: float = typer.Option(1200.0, "--shift-at", help="replay: seconds until the workload shifts"),
    static_after: float = typer.Option(0.8, "--static-after", help="replay: the static draft's s after it"),
    adapt_work: float = typer.Option(2400.0, "--adapt-work", help="replay: training-unit seconds to relearn"),
    kustomize: Path | None = typer.Option(
        None, "--kustomize", help="write a kustomize overlay of infra/k8s/base for the first s here"
    ),
) -> None:
    """Assign GPU classes to inference and training; replay a workload shift on the cluster."""
    import os

    import yaml

    from tide.infra.plan.cluster import Cluster
    from tide.infra.plan.planner import kustomize_overlay, placement_manifest, plan
    from tide.infra.plan.simulate import Shift, plot_replay, replay

    try:
        cluster = Cluster.load(cluster_file)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise typer.BadParameter(str(e), param_hint="--cluster") from None
    speedups = speedup or cluster.speedups
    if not speedups:
        raise typer.BadParameter(
            "give --speedup or list speedups in the cluster file", param_hint="--speedup"
        )
    shift = Shift(seconds=3 * shift_at, shift_at=shift_at, static_after=static_after, adapt_work=adapt_work)
    placements = [plan(cluster, s) for s in speedups]
    manifests = [placement_manifest(p, cluster) for p in placements]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump({"placements": manifests}, sort_keys=False))
    replays = [replay(cluster, p, shift) for p in placements]
    for m in manifests:
        typer.echo(f"s = {m['speedup']:.3f}: gain {m['gain_over_all_inference']:.3f}x. {m['explanation']}")
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        rows = [{**m, "replay": r.totals()} for m, r in zip(manifests, replays, strict=True)]
        report.write_text(json.dumps({"cluster": str(cluster_file), "placements": rows}, indent=2))
    if plot is not None:
        plot_replay(replays[0], shift, plot)
    if kustomize is not None:
        kustomize.mkdir(parents=True, exist_ok=True)
        base = os.path.relpath(
            Path(__file__).resolve().parent.parent / "infra" / "k8s" / "base", kustomize.resolve()
        )
        for name, text in kustomize_overlay(placements[0], cluster, base).items():
            (kustomize / name).write_text(text)
        typer.echo(f"kustomize overlay: {kustomize}")
    typer.echo(f"placement: {out}")


@bench_app.command("spec")
def bench_spec(
    prompts: Path = typer.Option(..., "--prompts"),
    draft: Path = typer.Option(..., "--draft"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    batch_size: int = typer.Option(1, "--batch-size"),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
    weights: str = typer.Option("auto", "--weights", help=WEIGHTS_HELP),
    compile: bool = typer.Option(True, "--compile/--no-compile", help=COMPILE_HELP),
    gamma: int = typer.Option(4, "--gamma"),
    part: str = typer.Option("test", "--part", help="train, test or all lines of the prompt file"),
    limit: int = typer.Option(16, "--limit", help="prompts to run (0: all)"),
    model: str | None = typer.Option(None, "--model"),
    out: Path = typer.Option(Path("out/bench_spec.json"), "--out"),
    plot: Path | None = typer.Option(None, "--plot", help="PNG: throughput and acceptance by depth"),
    llama_cpp: bool = typer.Option(
        True, "--llama-cpp/--no-llama-cpp", help="also time llama.cpp when installed"
    ),
    engine: str = typer.Option(
        "tide", "--engine", help="vllm: also vLLM without and with the draft (`make vllm` installs it)"
    ),
    proposer: str = typer.Option(
        "draft",
        "--proposer",
        help="suffix or hybrid: also that proposer, at the fixed gamma and adaptive, beside the draft alone",
    ),
) -> None:
    """Speculation off, on at a fixed gamma (also with a no-op tap) and adaptive, interleaved in one process."""
    from tide.bench.spec import SpecBenchConfig, plot_spec_report, run_spec_bench

    _check_proposer(proposer)
    cfg = SpecBenchConfig(
        prompts,
        draft,
        max_new_tokens,
        batch_size,
        _dtype(dtype),
        gamma,
        part,
        limit,
        model,
        llama_cpp,
        engine,
        proposer,
        _weights(weights),
        compile,
    )
    with _clear_errors():
        report = run_spec_bench(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    keys = ("speedup", "adaptive_speedup", "predicted_speedup", "greedy_match_rate", "tap_overhead")
    summary = {k: report[k] for k in keys}
    summary["baseline_tps"] = report["baseline"]["tokens_per_s"]
    summary["speculative_tps"] = report["speculative"]["tokens_per_s"]
    if "proposer" in report:
        summary["proposer_tps"] = report["proposer"]["tokens_per_s"]
        summary["proposer_over_draft"] = report["proposer_over_draft"]
        summary["adaptive_proposer_speedup"] = report["adaptive_proposer_speedup"]
    for key in ("llama_cpp", "vllm", "vllm_speculative"):
        if key in report:
            summary[f"{key}_tps"] = report[key]["tokens_per_s"]
    typer.echo(json.dumps(summary, indent=2))
    if plot is not None:
        plot_spec_report(report, plot)
        typer.echo(f"plot: {plot}")
    typer.echo(f"report: {out}")


@bench_app.command("shift")
def bench_shift(
    schedule: str = typer.Option(
        ..., "--schedule", help="prompt files, one per phase: A.jsonl,B.jsonl,C.jsonl"
    ),
    static_draft: Path = typer.Option(
        ..., "--static-draft", help="the draft trained on the first workload only"
    ),
    phase_seconds: float = typer.Option(600.0, "--phase-seconds"),
    slot_seconds: float = typer.Option(4.0, "--slot-seconds", help="each system serves this long in turn"),
    window_seconds: float = typer.Option(30.0, "--window-seconds"),
    max_batch: int = typer.Option(1, "--max-batch", help="1: where speculation pays most on a CPU"),
    max_new_tokens: int = typer.Option(96, "--max-new-tokens"),
    model: str | None = typer.Option(None, "--model"),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
    weights: str = typer.Option("auto", "--weights", help=WEIGHTS_HELP),
    compile: bool = typer.Option(True, "--compile/--no-compile", help=COMPILE_HELP),
    work_dir: Path | None = typer.Option(
        None, "--work-dir", help="keep broker, registry, trainer state here (default: removed after the run)"
    ),
    out: Path = typer.Option(Path("out/bench_shift.json"), "--out"),
    plot: Path | None = typer.Option(None, "--plot", help="PNG: throughput ratio and acceptance over time"),
    engine: str = typer.Option(
        "tide", "--engine", help="vllm: the three systems are vLLM servers (`make vllm` installs it)"
    ),
    proposer: str = typer.Option("draft", "--proposer", help="TIDE's node: " + PROPOSER_HELP),
    verbose: bool = typer.Option(False, "--verbose"),
) -> None:
    """No speculation, a static draft and TIDE (the whole loop live) through a workload shift."""
    from tide.bench.shift import ShiftBenchConfig, plot_shift_report, run_shift_bench

    _check_proposer(proposer)
    _setup_logging(verbose)
    files = [Path(p.strip()) for p in schedule.split(",") if p.strip()]
    for f in files:
        if not f.exists():
            raise typer.BadParameter(f"no such prompt file: {f}", param_hint="--schedule")
    cfg = ShiftBenchConfig(files, static_draft, phase_seconds=phase_seconds, slot_seconds=slot_seconds,
                           window_seconds=window_seconds, max_batch=max_batch, max_new_tokens=max_new_tokens,
                           model=model, work_dir=work_dir, dtype=_dtype(dtype), engine=engine,
                           proposer=proposer, weights=_weights(weights), compile=compile)  # fmt: skip
    if engine not in ("tide", "vllm"):
        raise typer.BadParameter("tide or vllm", param_hint="--engine")
    if not (static_draft / "model.safetensors").is_file():
        raise typer.BadParameter(f"no draft in {static_draft}", param_hint="--static-draft")
    if engine == "vllm" and proposer != "draft":
        raise typer.BadParameter("a vLLM node drafts with the draft only", param_hint="--proposer")
    if engine == "vllm" and max_batch != 1:
        raise typer.BadParameter(
            "with vLLM each system sends one request at a time", param_hint="--max-batch"
        )
    with _clear_errors():
        report = run_shift_bench(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    typer.echo(json.dumps(report["phases"], indent=2))
    if plot is not None:
        plot_shift_report(report, plot)
        typer.echo(f"plot: {plot}")
    typer.echo(f"report: {out}")


@bench_app.command("weights")
def bench_weights(
    modes: str = typer.Option("bf16,int8,int4,gguf", "--modes", help="weight modes to compare"),
    quality_prompts: int = typer.Option(8, "--quality-prompts", help="held-out prompts per workload"),
    speed_prompts: int = typer.Option(4, "--speed-prompts", help="held-out code prompts per round"),
    rounds: int = typer.Option(3, "--rounds"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    ttft_tokens: int = typer.Option(250, "--ttft-tokens", help="prompt length for time to first token"),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
    compile: bool = typer.Option(True, "--compile/--no-compile", help=COMPILE_HELP),
    llama_cpp: bool = typer.Option(True, "--llama-cpp/--no-llama-cpp", help="also llama.cpp when installed"),
    model: str | None = typer.Option(None, "--model"),
    out: Path = typer.Option(Path("out/bench_weights.json"), "--out"),
    plot: Path | None = typer.Option(None, "--plot", help="PNG: speed and quality per mode"),
) -> None:
    """Each weight mode's top-1 agreement and KL against fp32, and its decode speed and time to first
    token beside llama.cpp (no speculation, batch 1)."""
    from tide.bench.weights import WeightsBenchConfig, plot_weights_report, run_weights_bench

    chosen = tuple(_weights(m.strip()) for m in modes.split(",") if m.strip())
    if not chosen or "auto" in chosen:
        raise typer.BadParameter("name the modes, e.g. bf16,int4,gguf", param_hint="--modes")
    for name, value in (("--quality-prompts", quality_prompts), ("--speed-prompts", speed_prompts),
                        ("--rounds", rounds), ("--max-new-tokens", max_new_tokens), ("--ttft-tokens", ttft_tokens)):  # fmt: skip
        if value < 1:
            raise typer.BadParameter("must be at least 1", param_hint=name)
    cfg = WeightsBenchConfig(
        modes=chosen, quality_prompts=quality_prompts, speed_prompts=speed_prompts, rounds=rounds,
        max_new_tokens=max_new_tokens, ttft_tokens=ttft_tokens, dtype=_dtype(dtype), compile=compile,
        llama_cpp=llama_cpp, model=model,
    )  # fmt: skip
    with _clear_errors():
        report = run_weights_bench(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    summary = {m: {"tokens_per_s": round(v["tokens_per_s"], 1), "ttft_ms": round(v["ttft_s"] * 1e3, 1)}
               for m, v in report["speed"].items()}  # fmt: skip
    for m, q in report["quality"].items():
        summary[m].update(top1=round(q["all"]["top1_agreement"], 4), kl=round(q["all"]["mean_kl"], 5))
    typer.echo(json.dumps(summary, indent=2))
    if plot is not None:
        plot_weights_report(report, plot)
        typer.echo(f"plot: {plot}")
    typer.echo(f"report: {out}")


@bench_app.command("records")
def bench_records(
    prompts: Path = typer.Option(..., "--prompts"),
    out: Path = typer.Option(Path("out/bench_records.json"), "--out"),
    limit: int = typer.Option(32, "--limit", help="prompts the target answers"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    codecs: str = typer.Option("bf16,int8-g64,fp8-g64,int4-g32", "--codecs"),
    train_steps: int = typer.Option(
        200, "--train-steps", help="training steps per draft compared (0: no drafts, no τ ratios)"
    ),
    seeds: str = typer.Option("0", "--seeds", help="training seeds, e.g. 0,1,2: τ ratios are their median"),
    model: str | None = typer.Option(None, "--model"),
    weights: str = typer.Option("auto", "--weights", help=WEIGHTS_HELP),
    plot: Path | None = typer.Option(None, "--plot", help="PNG: bytes, error and draft quality per codec"),
) -> None:
    """Record codecs: bytes per token, fidelity, draft quality; and capture's cost to serving."""
    from tide.bench.records import RecordsBenchConfig, plot_records_report, run_records_bench
    from tide.producers.records import CODECS

    chosen = tuple(c.strip() for c in codecs.split(",") if c.strip())
    if not chosen or any(c not in CODECS for c in chosen):
        raise typer.BadParameter(f"choose from {', '.join(CODECS)}", param_hint="--codecs")
    try:
        seed_list = tuple(int(x) for x in seeds.split(","))
    except ValueError:
        raise typer.BadParameter("comma-separated integers", param_hint="--seeds") from None
    cfg = RecordsBenchConfig(prompts, limit, max_new_tokens, chosen, train_steps, seed_list, model=model,
                             weights=_weights(weights))  # fmt: skip
    with _clear_errors():
        report = run_records_bench(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    keep = ("bytes_per_token", "rel_error_median", "rel_error_p95", "target_kl", "draft_tau_ratio",
            "capture_overhead")  # fmt: skip
    brief = {
        c: {k: r[k] if r[k] is None else round(r[k], 4) for k in keep} for c, r in report["codecs"].items()
    }
    brief["raw_bf16_bytes_per_token"] = round(report["raw_bf16_bytes_per_token"], 1)
    typer.echo(json.dumps(brief, indent=2))
    if plot is not None:
        plot_records_report(report, plot)
        typer.echo(f"plot: {plot}")
    typer.echo(f"report: {out}")


@bench_app.command("training")
def bench_training(
    prompts: Path = typer.Option(..., "--prompts"),
    out: Path = typer.Option(Path("out/bench_training.json"), "--out"),
    requests: int = typer.Option(600, "--requests", help="requests served (the prompt file is cycled)"),
    max_new_tokens: int = typer.Option(160, "--max-new-tokens"),
    slice_requests: int = typer.Option(
        8, "--slice-requests", help="requests served between trainer catch-ups"
    ),
    keep_slices: float = typer.Option(
        1.5,
        "--keep-slices",
        help="the topic is sized to keep this many slices of traffic (the trainer's lag)",
    ),
    replay_positions: int = typer.Option(2048, "--replay-positions"),
    model: str | None = typer.Option(None, "--model"),
    weights: str = typer.Option("auto", "--weights", help=WEIGHTS_HELP),
) -> None:
    """TIDE's trainer (states from Kafka) against re-running the target's prefill (SpecForge online)."""
    from tide.bench.training import TrainingBenchConfig, run_training_bench

    if keep_slices <= 0:
        raise typer.BadParameter("a positive number of slices", param_hint="--keep-slices")

    cfg = TrainingBenchConfig(
        prompts, requests, max_new_tokens, slice_requests, replay_positions=replay_positions,
        keep_slices=keep_slices, model=model, weights=_weights(weights),
    )  # fmt: skip
    with _clear_errors():
        report = run_training_bench(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    keys = ("speedup", "speedup_expected", "decode_share", "tide_tau", "baseline_tau", "storage_ratio",
            "codec_factor", "retention_factor", "positions")  # fmt: skip
    typer.echo(json.dumps({k: report[k] for k in keys}, indent=2))
    typer.echo(f"report: {out}")


@bench_app.command("faults")
def bench_faults(
    minutes: float = typer.Option(
        10.0, "--minutes", help="how long the load runs (faults start after warm-up)"
    ),
    clients: int = typer.Option(3, "--clients", help="well-formed clients, one request in flight each"),
    max_tokens: int = typer.Option(48, "--max-tokens"),
    warmup: float = typer.Option(60.0, "--warmup", help="seconds before the first fault"),
    draft: Path | None = typer.Option(
        None, "--draft", help="the starting draft (default: the default draft)"
    ),
    model: str | None = typer.Option(None, "--model"),
    work_dir: Path | None = typer.Option(
        None, "--work-dir", help="keep the stack's state and logs here (default: removed after the run)"
    ),
    out: Path = typer.Option(Path("out/bench_faults.json"), "--out"),
    plot: Path | None = typer.Option(None, "--plot", help="PNG: load, faults and latency over time"),
    verbose: bool = typer.Option(False, "--verbose"),
) -> None:
    """The whole stack under steady load while restarts, kills, poison records and bad drafts strike."""
    from tide.bench.faults import FaultsBenchConfig, plot_faults_report, run_faults_bench

    _setup_logging(verbose)
    if minutes * 60 < warmup + 120:
        raise typer.BadParameter("leave at least two minutes after the warm-up", param_hint="--minutes")
    cfg = FaultsBenchConfig(minutes=minutes, clients=clients, max_tokens=max_tokens, warmup_seconds=warmup,
                            draft=draft, model=model, work_dir=work_dir)  # fmt: skip
    with _clear_errors():
        report = run_faults_bench(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    keys = (
        "requests",
        "well_formed_failed",
        "hostile_5xx",
        "records",
        "served_refused_versions",
        "latency_ms",
    )
    typer.echo(
        json.dumps(
            {k: report[k] for k in keys}
            | {"rss_growth": {k: v["growth"] for k, v in report["rss_mb"].items()}},
            indent=2,
        )
    )
    if plot is not None:
        plot_faults_report(report, plot)
        typer.echo(f"plot: {plot}")
    typer.echo(f"report: {out}")


if __name__ == "__main__":
    app()
