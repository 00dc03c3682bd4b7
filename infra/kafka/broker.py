"""A real single-node Apache Kafka 4.x broker (KRaft, broker+controller in one JVM) for tests and the local stack.

The jars come from Maven Central through `mvn` (no Docker, no Apache download site); the JVM runs with a small heap
because it shares the machine with many other processes.

    python -m tide.infra.kafka.broker [--port N] [--data DIR]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tide.config import cache_dir
from tide.infra.process import LocalService, free_port, tail

HERE = Path(__file__).resolve().parent
POM = HERE / "pom.xml"
LOG4J = HERE / "log4j2.xml"
# Kafka runs fine on C1 and the serial collector; both keep the JVM's native memory (RSS) well under the default.
JVM_OPTS = (
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:ReservedCodeCacheSize=48m",
    "-Djava.awt.headless=true",
)


class BrokerError(RuntimeError):
    """The broker could not be built, started or reached; the message ends with the relevant output."""


def kafka_jars() -> Path:
    """The folder of Kafka's jars, resolved once per pom.xml into the TIDE cache (outside the repo)."""
    digest = hashlib.sha256(POM.read_bytes()).hexdigest()[:12]
    root = cache_dir() / "kafka"
    dest = root / digest
    if dest.is_dir():  # only ever created by the rename below, so it is complete
        return dest
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError("`mvn` is not on PATH: install Maven (and Java 17+) to resolve the Kafka jars")
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=root))
    try:
        # run on a copy so Maven never writes next to the installed package (which may be read-only)
        shutil.copy(POM, work / "pom.xml")
        cmd = [mvn, "-q", "-B", "-f", str(work / "pom.xml"), "dependency:copy-dependencies"]
        cmd.append(f"-DoutputDirectory={work / 'jars'}")
        res = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=900)
        if res.returncode != 0 or not list((work / "jars").glob("kafka_2.13-*.jar")):
            raise BrokerError(
                f"mvn could not resolve the Kafka jars (rc={res.returncode}):\n"
                + tail(res.stdout + res.stderr)
            )
        try:
            (work / "jars").rename(dest)
        except OSError:
            if not dest.is_dir():  # a concurrent resolver winning the race is fine; anything else is not
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def _cluster_id() -> str:
    # Kafka's Uuid.toString(): 16 random bytes, url-safe base64 without padding, never starting with '-'
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


@dataclass
class KafkaBroker(LocalService):
    """One KRaft node (broker+controller) whose logs and metadata live in `data_dir`.

    Ports left as None are picked at start (or read back from an earlier run on the same data dir) and then kept,
    so `restart()` comes back where clients expect it.
    """

    data_dir: Path
    port: int | None = None
    controller_port: int | None = None
    # the clients' listener (0.0.0.0: every interface); the controller stays on the loopback
    host: str = "127.0.0.1"
    heap: str = "-Xmx256m -Xms64m"
    max_message_bytes: int = 2 * 1024 * 1024
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def bootstrap(self) -> str:
        if self.port is None:
            raise BrokerError("the broker has no port yet: call start() first")
        return f"{self._client_host}:{self.port}"

    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host

    @property
    def log_path(self) -> Path:
        return self.data_dir / "broker.log"

    def _ports(self) -> None:
        saved = self.data_dir / "ports.json"
        old = json.loads(saved.read_text()) if saved.exists() else {}
        # the controller's own endpoint is part of the formatted quorum, so a restarted data dir keeps its ports
        self.port = self.port or old.get("port") or free_port()
        self.controller_port = self.controller_port or old.get("controller_port") or free_port()
        saved.write_text(json.dumps({"port": self.port, "controller_port": self.controller_port}))

    def _properties(self) -> Path:
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://{self.host}:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self._client_host}:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.data_dir / "logs"),
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "num.partitions": "1",
            "auto.create.topics.enable": "false",
            "message.max.bytes": str(self.max_message_bytes),
            "replica.fetch.max.bytes": str(self.max_message_bytes),
            # fewer threads and a small cleaner buffer (default 128 MB of heap) for a one-client test broker
            "num.network.threads": "2",
            "num.io.threads": "4",
            "background.threads": "2",
            "log.cleaner.dedupe.buffer.size": str(8 * 1024 * 1024),
            **self.extra,
        }
        path = self.data_dir / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def _java(self, jars: Path, *args: str) -> list[str]:
        java = shutil.which("java")
        if java is None:
            raise BrokerError("`java` is not on PATH: install a Java 17+ runtime to run Kafka")
        return [java, *self.heap.split(), *JVM_OPTS, f"-Dlog4j2.configurationFile={LOG4J}",
                "-cp", f"{jars}/*", *args]  # fmt: skip

    def start(self, timeout: float = 120) -> KafkaBroker:
        if self.running:
            return self
        self.stop()  # a broker that died on its own: reap it and close its log
        jars = kafka_jars()
        self.data_dir = Path(self.data_dir).resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._ports()
        config = self._properties()
        # format only once, so a restart (or a later run on the same data dir) keeps topics and offsets
        if not (self.data_dir / "logs" / "meta.properties").exists():
            fmt = self._java(jars, "kafka.tools.StorageTool", "format", "--standalone",
                             "-t", _cluster_id(), "-c", str(config))  # fmt: skip
            res = subprocess.run(fmt, capture_output=True, text=True, timeout=timeout)
            if res.returncode != 0:
                raise BrokerError("kafka-storage format failed:\n" + tail(res.stdout + res.stderr))
        self._launch(self._java(jars, "kafka.Kafka", str(config)), None, timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout
        # wait for the listener before making a client, so librdkafka does not log connection-refused noise
        while not self._accepts():
            self._check_alive()
            if time.monotonic() > deadline:
                raise BrokerError(f"no listener on {self.bootstrap} after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.2)
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        last: Exception | None = None
        while True:
            self._check_alive()
            try:
                if admin.list_topics(timeout=2).brokers:
                    return
            except Exception as e:  # KafkaException while the broker is still catching up
                last = e
            if time.monotonic() > deadline:
                raise BrokerError(f"broker not ready after {timeout:.0f}s ({last}):\n{self.log_tail()}")
            time.sleep(0.2)

    def _accepts(self) -> bool:
        try:
            with socket.create_connection((self._client_host, self.port or 0), timeout=1):
                return True
        except OSError:
            return False

    def _check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise BrokerError(f"the broker exited with {self.process.returncode}:\n{self.log_tail()}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tide.infra.kafka.broker", description="Run a single-node Kafka broker until Ctrl-C."
    )
    parser.add_argument("--port", type=int, default=None, help="PLAINTEXT port (default: a free one)")
    parser.add_argument(
        "--controller-port", type=int, default=None, help="CONTROLLER port (default: a free one)"
    )
    parser.add_argument("--data", type=Path, default=None, help="data dir, kept (default: a temporary one)")
    parser.add_argument("--heap", default=KafkaBroker.heap, help="JVM heap options")
    args = parser.parse_args(argv)
    # a supervisor's SIGTERM must unwind through stop(): the JVM is in its own process group and would outlive us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    tmp: Path | None = None
    data: Path | None = args.data
    if data is None:
        data = tmp = Path(tempfile.mkdtemp(prefix="tide-kafka-"))
    broker = KafkaBroker(data, args.port, args.controller_port, heap=args.heap)
    try:
        with broker:
            print(f"kafka broker ready: bootstrap={broker.bootstrap} data={broker.data_dir} log={broker.log_path}",
                  flush=True)  # fmt: skip
            while broker.running:
                time.sleep(1)
            raise SystemExit(f"error: the broker exited:\n{broker.log_tail()}")
    except KeyboardInterrupt:
        print("stopping", flush=True)
    except BrokerError as e:
        raise SystemExit(f"error: {e}") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
