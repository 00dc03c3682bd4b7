"""`tide up`: the whole loop on one machine, nothing installed by hand; `tide status`: how it does.

`tide up` starts a Kafka broker (Maven jars), an MLflow server (sqlite; artifacts in a folder, or in
a local S3 server with `--s3`), the gate and a serving node, which answers at once. The first draft
arrives through the loop: the starting draft (`--draft`, else the cached default draft) is the
`default` workload's first champion; on a machine without one, a job of the stack trains the
default draft (once, then cached) and registers it, the node swaps it in from the registry, and the
trainers (one per workload) start from it. Every part runs in its own process and session, so Ctrl-C
reaches `tide up` alone, which stops them all, newest first. Where everything listens is written to
`<data>/stack.json`, which `tide status` reads.

Secrets (`StackSecrets`: S3 keys per role, the Postgres password of the container stacks) are random,
made once and kept in `<data>/secrets.env` (0600), which `docker compose --env-file` also reads. Every
service listens on `--host`, 127.0.0.1 unless asked.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx

from tide.infra.kafka.broker import KafkaBroker
from tide.infra.mlflow.server import MlflowServer
from tide.infra.process import LocalService, log_tail, stop_groups, wait_http_ok
from tide.infra.s3.server import S3Server
from tide.names import MODEL_PREFIX, model_name, topic_for, trainer_group

log = logging.getLogger("tide.stack")


@dataclass
class StackConfig:
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    mlflow_port: int = 5000
    workloads: list[str] = field(default_factory=lambda: ["default"])  # one trainer each
    s3: bool = False
    draft: Path | None = None  # default: the default draft, trained once from the shipped workloads
    model: str | None = None
    # more flags for the parts' commands, after the stack's own (a flag given again wins):
    # {"serve": [...], "train": [...], "gate": [...], "draft": [...]}
    extra: dict[str, list[str]] = field(default_factory=dict)
    engine: str = "tide"  # the serving node's: tide, or vllm (a fixed gamma; needs a draft to start)


@dataclass(frozen=True)
class StackSecrets:
    """The stack's credentials, one S3 account per role: root (the S3 server alone), trainer (writes the
    artifact bucket: trainers, MLflow, the stack's starting draft) and serving (reads it: serving nodes and
    the gate); the Postgres password is the container stacks' (MLflow's database). Names as in compose."""

    TIDE_S3_ROOT_ACCESS_KEY: str
    TIDE_S3_ROOT_SECRET_KEY: str
    TIDE_S3_TRAINER_ACCESS_KEY: str
    TIDE_S3_TRAINER_SECRET_KEY: str
    TIDE_S3_SERVING_ACCESS_KEY: str
    TIDE_S3_SERVING_SECRET_KEY: str
    TIDE_POSTGRES_PASSWORD: str

    @classmethod
    def generate(cls) -> StackSecrets:
        # hex: safe in env files, URLs (the database URI) and YAML, never quoted
        return cls(**{f.name: secrets.token_hex(20) for f in fields(cls)})

    @classmethod
    def load_or_create(cls, path: Path) -> StackSecrets:
        """The secrets kept at `path`, with any missing (a file from an older version) made and written."""
        old: dict[str, str] = {}
        if path.exists():
            lines = path.read_text().splitlines()
            old = dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
        made = cls(**{f.name: old.get(f.name) or secrets.token_hex(20) for f in fields(cls)})
        if set(old) != {f.name for f in fields(cls)} or path.stat().st_mode & 0o077:
            made.write(path)
        return made

    def write(self, path: Path) -> None:
        """`path` as KEY=VALUE lines, readable by its owner alone (0600 from the first byte)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write("# tide: generated secrets, keep private\n")
            out.writelines(f"{k}={v}\n" for k, v in asdict(self).items())
        os.replace(tmp, path)

    def write_k8s(self, folder: Path) -> list[Path]:
        """The env files the k8s base's secretGenerator reads (infra/k8s/base/secrets/, git-ignored)."""
        files = {
            "s3-root.env": {"ROOT_ACCESS_KEY_ID": self.TIDE_S3_ROOT_ACCESS_KEY,
                            "ROOT_SECRET_ACCESS_KEY": self.TIDE_S3_ROOT_SECRET_KEY},
            "s3-trainer.env": {"AWS_ACCESS_KEY_ID": self.TIDE_S3_TRAINER_ACCESS_KEY,
                               "AWS_SECRET_ACCESS_KEY": self.TIDE_S3_TRAINER_SECRET_KEY},
            "s3-serving.env": {"AWS_ACCESS_KEY_ID": self.TIDE_S3_SERVING_ACCESS_KEY,
                               "AWS_SECRET_ACCESS_KEY": self.TIDE_S3_SERVING_SECRET_KEY},
            "postgres.env": {"POSTGRES_PASSWORD": self.TIDE_POSTGRES_PASSWORD},
        }  # fmt: skip
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for name, values in files.items():
            fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.writelines(f"{k}={v}\n" for k, v in values.items())
            os.chmod(folder / name, 0o600)  # a file that was there keeps its mode through O_CREAT
            written.append(folder / name)
        return written


def secrets_path(data_dir: Path) -> Path:
    return data_dir / "secrets.env"


PartSpec = tuple[str, str, list[str]]  # a part to start: name, role, `tide` arguments


@dataclass
class Part:
    """A `tide` process of the stack."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    role: str = ""  # whose S3 account it holds: "trainer" or "serving"
    args: list[str] = field(default_factory=list)  # its `tide` command, to start it again as it was
    started: float = field(default_factory=time.monotonic)
    crashes: int = 0  # exits in a row that came soon after a start
    job: bool = False  # runs to its end once: done when it exits 0
    then: list[PartSpec] = field(default_factory=list)  # parts to start when the job is done


class StackError(RuntimeError):
    pass


QUICK_EXIT = 60.0  # seconds: a part that exits sooner after its start counts as a crash at start-up
MAX_CRASHES = 5
MAX_BACKOFF = 30.0


BUCKET = MlflowServer.bucket  # S3 mode: MLflow's artifacts


@contextlib.contextmanager
def as_account(env: dict[str, str]) -> Iterator[None]:
    """This process talks to S3 with the account in `env` for the block only (we may be a library)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _forget_s3_clients()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _forget_s3_clients()


def _forget_s3_clients() -> None:
    """boto3's default session keeps the keys it first read, and MLflow caches its S3 clients by endpoint,
    not by keys: both would go on calling with the previous account."""
    import boto3
    from mlflow.store.artifact import s3_artifact_repo

    boto3.DEFAULT_SESSION = None
    s3_artifact_repo._cached_get_s3_client.cache_clear()


def _tide() -> str:
    return str(Path(sys.executable).parent / "tide")


class Stack:
    def __init__(self, cfg: StackConfig):
        self.cfg = cfg
        self.services: list[LocalService] = []
        self.parts: list[Part] = []
        self.kafka: KafkaBroker | None = None
        self.mlflow: MlflowServer | None = None
        self.secrets = StackSecrets.load_or_create(secrets_path(cfg.data_dir))
        self.role_env: dict[str, dict[str, str]] = {}  # S3 mode: "trainer"/"serving" -> that account's env
        self.has_champion = False  # the `default` workload has a draft to start from

    @property
    def endpoint(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    def steps(self) -> list[str]:
        return ["kafka", *(["s3"] if self.cfg.s3 else []), "mlflow", "register", "gate", "serving", "trainer"]

    def start_step(self, step: str) -> None:
        cfg, data = self.cfg, self.cfg.data_dir
        if step == "kafka":
            self.kafka = KafkaBroker(data / "kafka", heap="-Xmx384m -Xms64m", host=cfg.host).start()
            self.services.append(self.kafka)
        elif step == "s3":
            s3 = self.s3_server().start()
            self.services.append(s3)
            self._s3_accounts(s3)
        elif step == "mlflow":
            store = next((s for s in self.services if isinstance(s, S3Server)), None)
            self.mlflow = MlflowServer(data / "mlflow", cfg.mlflow_port, cfg.host, s3=store, bucket=BUCKET,
                                       env=self.role_env.get("trainer", {})).start()  # fmt: skip
            self.services.append(self.mlflow)
        elif step == "register":
            self.has_champion = self._register_start_draft()
        elif step == "trainer":
            draft = ["--start-draft", str(cfg.draft)] if cfg.draft else []
            trainers = [(f"trainer:{w}", "trainer",
                         ["train", "--kafka", self.bootstrap, "--workload", w, "--mlflow", self.registry,
                          "--state-dir", str(self.trainer_state_dir(w)), *draft, *self._model(),
                          *cfg.extra.get("train", [])]) for w in cfg.workloads]  # fmt: skip
            if self.has_champion:
                for name, role, args in trainers:
                    self._spawn(name, role, args)
            else:  # trainers start from the first champion: after the job that makes it
                self._spawn("draft", "trainer", ["draft", "ensure-default", "--register", self.registry,
                                                 *self._model(), *cfg.extra.get("draft", [])], job=True,
                            then=trainers)  # fmt: skip
        elif step == "gate":
            self._spawn(
                "gate",
                "serving",  # the gate reads candidates and champions; it writes tags through MLflow
                ["gate", "--mlflow", self.registry, "--kafka", self.bootstrap, *self._model(),
                 *cfg.extra.get("gate", [])],
            )  # fmt: skip
        elif step == "serving":
            draft = ["--draft", str(cfg.draft)] if cfg.draft else []
            gamma = "auto" if cfg.engine == "tide" else "3"  # vLLM drafts a fixed number of tokens
            self._spawn("serving", "serving",
                        ["serve", "--engine", cfg.engine, "--host", cfg.host, "--port", str(cfg.port), "--gamma", gamma, "--kafka",
                         self.bootstrap, "--capture", "*=auto", "--registry", self.registry, "--workloads",
                         ",".join(cfg.workloads), *draft, *self._model(), *cfg.extra.get("serve", [])])  # fmt: skip
            self._wait_serving(600)
        self._write_state()

    def s3_server(self) -> S3Server:
        """The local S3 server: root keys from the stack's secrets, its own accounts per role."""
        root = (self.secrets.TIDE_S3_ROOT_ACCESS_KEY, self.secrets.TIDE_S3_ROOT_SECRET_KEY)
        return S3Server(self.cfg.data_dir / "s3", host=self.cfg.host, access_key=root[0], secret_key=root[1],
                        users=True)  # fmt: skip

    def _s3_accounts(self, s3: S3Server) -> None:
        """The trainer account writes the artifact bucket, the serving account only reads it; root stays here."""
        sec = self.secrets
        keys = {"trainer": (sec.TIDE_S3_TRAINER_ACCESS_KEY, sec.TIDE_S3_TRAINER_SECRET_KEY),
                "serving": (sec.TIDE_S3_SERVING_ACCESS_KEY, sec.TIDE_S3_SERVING_SECRET_KEY)}  # fmt: skip
        s3.ensure_bucket(BUCKET)
        for access, secret in keys.values():
            s3.add_user(access, secret)
        s3.grant(BUCKET, readers=[keys["serving"][0]], writers=[keys["trainer"][0]])
        self.role_env = {role: s3.env_for(*k) for role, k in keys.items()}

    def _register_start_draft(self) -> bool:
        """The draft the stack starts from is the `default` workload's first champion, so the registry
        (and the MLflow UI) shows what serves. Whether there is a champion now: without a starting
        draft on this machine, a job of the stack trains one (`start_step("trainer")`)."""
        from mlflow import MlflowClient

        from tide.config import default_draft_dir
        from tide.models.loader import load_head
        from tide.registry.store import CHAMPION, alias_version, ensure_champion
        from tide.registry.tags import source_tags

        fp = load_head(self.cfg.model).fingerprint
        folder = self.cfg.draft or default_draft_dir(fp)
        client = MlflowClient(self.registry)
        if (folder / "model.safetensors").exists():
            with as_account(self.role_env.get("trainer", {})):
                ensure_champion(client, fp, "default", folder, source_tags("tide up: the starting draft"))
            return True  # registered now, or a champion was there already
        return alias_version(client, model_name(fp, "default"), CHAMPION) is not None

    def trainer_state_dir(self, workload: str) -> Path:
        return self.cfg.data_dir / "trainers" / workload

    @property
    def bootstrap(self) -> str:
        assert self.kafka is not None
        return self.kafka.bootstrap

    @property
    def registry(self) -> str:
        assert self.mlflow is not None
        return self.mlflow.url

    def _model(self) -> list[str]:
        return ["--model", self.cfg.model] if self.cfg.model else []

    def _spawn(
        self,
        name: str,
        role: str,
        args: list[str],
        job: bool = False,
        then: list[PartSpec] | None = None,
    ) -> None:
        log = self.cfg.data_dir / "logs" / f"{name.replace(':', '-')}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.role_env.get(role, {})}  # S3 mode: the role's account, never root
        with log.open("ab") as out:
            proc = subprocess.Popen([_tide(), *args], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)  # fmt: skip
        self.parts.append(Part(name, proc, log, role, args, job=job, then=then or []))

    def _wait_serving(self, timeout: float) -> None:
        part = self.parts[-1]
        wait_http_ok(f"{self.endpoint}/health", part.proc, timeout, "the serving node", lambda: log_tail(part.log),
                     StackError)  # fmt: skip

    def _write_state(self) -> None:
        state = {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.cfg).items()},
            "endpoint": self.endpoint,
            "mlflow": self.mlflow.url if self.mlflow else None,
            "kafka": self.kafka.bootstrap if self.kafka else None,
            "processes": {p.name: {"pid": p.proc.pid, "log": str(p.log)} for p in self.parts},
        }
        (self.cfg.data_dir / "stack.json").write_text(json.dumps(state, indent=2))

    def revive(self) -> list[str]:
        """Start again every service and part that has died; return their names.

        A service that goes away degrades the loop and never stops it: a broker, MLflow or S3 server
        that exited starts again on its port and data, and so does a part, with the same command and
        S3 account. A part that keeps dying soon after its start waits longer each time (up to
        `MAX_BACKOFF`), and after `MAX_CRASHES` such exits in a row the stack gives up on it with
        StackError: it cannot start, and starting it again will not change that.
        """
        revived = []
        for s in self.services:
            if not s.running:
                try:
                    s.restart()
                except Exception as e:  # its port still held, say: try again at the next call
                    log.warning("could not start %s again: %s", type(s).__name__, e)
                    continue
                revived.append(type(s).__name__)
        now = time.monotonic()
        for i, p in enumerate(self.parts):
            if p.proc.poll() is None or (p.job and p.proc.poll() == 0):  # running, or a job done
                if p.crashes and now - p.started > QUICK_EXIT:
                    p.crashes = 0  # it has run a while: the next exit starts the count again
                continue
            crashes = p.crashes + 1 if now - p.started < QUICK_EXIT else 0
            if crashes >= MAX_CRASHES:
                raise StackError(f"{p.name} exited {crashes} times soon after starting:\n{log_tail(p.log)}")
            if now - p.started < min(MAX_BACKOFF, 2.0**crashes):
                continue  # wait a little before starting a part that just died
            self._spawn(p.name, p.role, p.args, p.job, p.then)
            self.parts[i] = self.parts.pop()
            self.parts[i].crashes = crashes
            revived.append(p.name)
        if revived:
            self._write_state()
        return revived

    def finish_jobs(self) -> list[str]:
        """Jobs that ended well leave the stack, and the parts that waited on them start; their names."""
        started = []
        for p in [p for p in self.parts if p.job and p.proc.poll() == 0]:
            self.parts.remove(p)
            for name, role, args in p.then:
                self._spawn(name, role, args)
                started.append(name)
        if started:
            self._write_state()
        return started

    def stop(self) -> None:
        stop_groups([p.proc for p in self.parts], 30)
        self.parts = []
        for s in reversed(self.services):
            s.stop()
        self.services = []


# -- tide status -------------------------------------------------------------------------------------
def _lag(bootstrap: str, group: str, topic: str) -> int | None:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        meta = c.list_topics(topic, timeout=5).topics.get(topic)
        if meta is None or meta.error is not None:
            return None
        tps = [TopicPartition(topic, p) for p in meta.partitions]
        lag = 0
        for tp in c.committed(tps, timeout=5):
            low, high = c.get_watermark_offsets(tp, timeout=5)
            lag += high - (tp.offset if tp.offset >= 0 else low)
        return lag
    finally:
        c.close()


def status(state_file: Path) -> list[dict[str, Any]]:
    """One row per part: its health and what it knows (draft, consumer lag, champions)."""
    state = json.loads(state_file.read_text())
    rows: list[dict[str, Any]] = []
    try:
        h = httpx.get(f"{state['endpoint']}/health", timeout=3).json()
        rows.append({"part": "serving", "state": "up", "detail": f"{state['endpoint']}  draft {h.get('draft')}  "
                     f"gamma {h.get('gamma')}  running {h.get('running')}  waiting {h.get('waiting')}"})  # fmt: skip
    except (httpx.HTTPError, ValueError) as e:
        rows.append({"part": "serving", "state": "down", "detail": str(e)})
    mlflow_up = False
    with contextlib.suppress(httpx.HTTPError):
        mlflow_up = httpx.get(f"{state['mlflow']}/health", timeout=3).status_code == 200
    rows.append({"part": "mlflow", "state": "up" if mlflow_up else "down", "detail": f"UI {state['mlflow']}"})
    workloads = state["config"]["workloads"]
    try:
        lags = {w: _lag(state["kafka"], trainer_group(w), topic_for(w)) for w in workloads}
        rows.append({"part": "kafka", "state": "up", "detail": state["kafka"]})
    except Exception as e:  # a broker that is away: no lag to show
        lags = {}
        rows.append({"part": "kafka", "state": "down", "detail": str(e)})
    for name, p in state["processes"].items():
        if name == "serving":
            continue
        alive = _alive(int(p["pid"]))
        detail = f"log {p['log']}"
        if name.startswith("trainer:"):
            lag = lags.get(name.split(":", 1)[1])
            detail = f"consumer lag {lag if lag is not None else 'n/a (no records yet)'}  {detail}"
        rows.append({"part": name, "state": "up" if alive else "down", "detail": detail})
    if mlflow_up:
        rows += _champions(state["mlflow"])
    return rows


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _champions(url: str) -> list[dict[str, Any]]:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from tide.registry.tags import VersionTags

    client = MlflowClient(url)
    rows = []
    for rm in client.search_registered_models(f"name LIKE '{MODEL_PREFIX}%'"):
        workload = (rm.tags or {}).get("workload", rm.name)
        try:
            mv = client.get_model_version_by_alias(rm.name, "champion")
            figures = VersionTags.from_tags(mv.tags).figures
            detail = f"{rm.name} v{mv.version}  gate score {f'{figures.score:.4f}' if figures else 'n/a'}"
        except MlflowException:
            detail = f"{rm.name}: no champion yet"
        rows.append({"part": f"champion:{workload}", "state": "", "detail": detail})
    return rows
