"""Deployment hardening (issue 30): docker-compose.yml and the k8s manifests rendered as they would be
deployed (`docker compose config`, `kustomize build`, the tools `make deploy-tools` builds), then
checked: no container runs as root or keeps capabilities, every container has limits, nothing is
published beyond the loopback, no credential is committed or defaulted, and each role holds only its
own credentials. Then the local stack's side: `tide up`'s secrets (random, 0600, kept) and its S3
accounts per role on a real versitygw."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from botocore.exceptions import ClientError
from typer.testing import CliRunner

from tide.cli import app
from tide.infra.kafka.broker import KafkaBroker
from tide.infra.process import free_port
from tide.infra.s3.server import S3Server
from tide.stack import BUCKET, Stack, StackConfig, StackSecrets, as_account, secrets_path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = Path(os.environ.get("TIDE_TOOLS", Path.home() / ".cache" / "tide" / "tools")) / "bin"
SECRET_NAME = ("PASSWORD", "SECRET", "ACCESS_KEY")  # an env var named so holds a credential


def tool(name: str) -> str:
    path = TOOLS / name
    assert path.is_file(), f"{path} is missing: `make deploy-tools` builds it"
    return str(path)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> StackSecrets:
    return StackSecrets.load_or_create(secrets_path(tmp_path_factory.mktemp("stack")))


# -- docker compose ------------------------------------------------------------------------------
def compose(profile: str, env_file: Path) -> subprocess.CompletedProcess[str]:
    # the caller's own TIDE_* variables (or a .env, which --env-file replaces) would fill in what the
    # file must not default
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDE_")}
    args = [tool("docker-compose"), "-f", str(ROOT / "docker-compose.yml"), "--env-file", str(env_file),
            "--profile", profile, "config", "--format", "json"]  # fmt: skip
    return subprocess.run(args, capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def services(made: StackSecrets, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    env_file = tmp_path_factory.mktemp("compose") / "secrets.env"
    made.write(env_file)
    rendered: dict[str, dict[str, Any]] = {}
    for profile in ("cpu", "gpu"):
        res = compose(profile, env_file)
        assert res.returncode == 0, res.stderr
        rendered |= json.loads(res.stdout)["services"]
    assert {"serving", "serving-gpu", "mlflow", "postgres", "s3", "trainer", "gate"} <= set(rendered)
    return rendered


def test_compose_has_no_default_credentials() -> None:
    res = compose("cpu", Path(os.devnull))
    assert res.returncode != 0
    for var in ("TIDE_POSTGRES_PASSWORD", "TIDE_S3_ROOT_SECRET_KEY", "TIDE_S3_SERVING_SECRET_KEY"):
        assert f"required variable {var} is missing" in res.stderr
    # and the committed file names every credential by a required variable, never a value
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    blocks = [raw[k] for k in raw if k.startswith("x-")] + list(raw["services"].values())
    for block in blocks:
        env = block.get("environment", block) if isinstance(block, dict) else {}
        for name, value in env.items():
            if isinstance(name, str) and any(s in name for s in SECRET_NAME):
                assert str(value).startswith("${TIDE_") and ":?" in str(value), f"{name}: {value}"
    assert "tide-secret-key" not in (ROOT / "docker-compose.yml").read_text()


def test_compose_containers_are_not_root_and_are_limited(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        user = str(svc.get("user", "")).split(":")[0]
        assert user not in ("", "0", "root"), f"{name} runs as root"
        assert svc.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in svc.get("security_opt", []), name
        limits = svc.get("deploy", {}).get("resources", {}).get("limits", {})
        assert limits.get("cpus") and limits.get("memory"), f"{name} has no cpu/memory limits"
        for port in svc.get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", f"{name} publishes {port} beyond the loopback"


def test_image_runs_as_its_own_user(services: dict[str, dict[str, Any]]) -> None:
    users = [line.split()[1] for line in (ROOT / "infra/docker/Dockerfile").read_text().splitlines()
             if line.startswith("USER ")]  # fmt: skip
    assert users and users[-1] == "10001:10001"  # the last USER is the one containers start as
    assert {svc["user"] for svc in services.values() if str(svc["image"]).startswith("tide:")} == {users[-1]}


def test_compose_credentials_per_role(services: dict[str, dict[str, Any]], made: StackSecrets) -> None:
    def holders(value: str) -> set[str]:
        return {name for name, svc in services.items() if value in json.dumps(svc)}

    assert holders(made.TIDE_POSTGRES_PASSWORD) == {"postgres", "mlflow"}
    assert holders(made.TIDE_S3_ROOT_SECRET_KEY) == {"s3", "s3-accounts", "s3-bucket"}
    # the draft job registers the first champion: it writes artifacts as trainers do
    assert holders(made.TIDE_S3_TRAINER_SECRET_KEY) == {"s3-accounts", "mlflow", "trainer", "draft"}
    assert holders(made.TIDE_S3_SERVING_SECRET_KEY) == {"s3-accounts", "serving", "serving-gpu", "gate"}
    for name in ("serving", "serving-gpu"):
        assert services[name]["environment"]["AWS_ACCESS_KEY_ID"] == made.TIDE_S3_SERVING_ACCESS_KEY
    # the password reaches MLflow through its environment, not its command line
    assert made.TIDE_POSTGRES_PASSWORD not in json.dumps(services["mlflow"].get("command"))


# -- kubernetes ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def k8s(made: StackSecrets, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every kustomization rendered, with the Secret env files `tide secrets --k8s` writes."""
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(ROOT / "infra" / "k8s", tree, ignore=shutil.ignore_patterns("*.env"))
    made.write_k8s(tree / "base" / "secrets")
    rendered = {}
    for folder in [tree / "base", *sorted((tree / "overlays").iterdir())]:
        res = subprocess.run([tool("kustomize"), "build", str(folder)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        rendered[folder.name] = [d for d in yaml.safe_load_all(res.stdout) if d]
    return rendered


def pods(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def test_no_secret_values_committed_in_k8s(made: StackSecrets) -> None:
    tracked = subprocess.run(["git", "ls-files", "infra/k8s"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()  # fmt: skip
    for path in tracked:
        if path.endswith((".yaml", ".yml")):
            for doc in yaml.safe_load_all((ROOT / path).read_text()):
                assert not (doc and doc.get("kind") == "Secret"), f"{path} commits a Secret"
        assert not path.endswith(".env"), f"{path}: a Secret's values are committed"
    env_file = ROOT / "infra/k8s/base/secrets/s3-root.env"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(env_file)], cwd=ROOT)
    assert ignored.returncode == 0, "the Secret env files must be git-ignored"


def test_k8s_pods_are_restricted_and_limited(k8s: dict[str, list[dict[str, Any]]]) -> None:
    for overlay, docs in k8s.items():
        ns = next(d for d in docs if d["kind"] == "Namespace")
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
        for name, pod in pods(docs):
            where = f"{overlay}/{name}"
            psc = pod.get("securityContext", {})
            assert psc.get("runAsNonRoot") is True, where
            assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
            assert pod.get("automountServiceAccountToken") is False, where
            for c in containers(pod):
                at = f"{where}/{c['name']}"
                sc = c.get("securityContext", {})
                assert sc.get("runAsUser", psc.get("runAsUser")) not in (None, 0), f"{at} may run as root"
                assert sc.get("allowPrivilegeEscalation") is False, at
                assert sc.get("capabilities", {}).get("drop") == ["ALL"], at
                # Kafka's image writes its configuration at start, into its own folder
                assert sc.get("readOnlyRootFilesystem") is (c["name"] != "kafka"), at
                res = c.get("resources", {})
                for kind in ("requests", "limits"):
                    assert {"cpu", "memory"} <= set(res.get(kind, {})), f"{at} has no cpu/memory {kind}"


def test_k8s_credentials_per_role(k8s: dict[str, list[dict[str, Any]]], made: StackSecrets) -> None:
    def secrets_of(c: dict[str, Any]) -> set[str]:
        refs = [e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e]
        refs += [e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                 if "secretKeyRef" in e.get("valueFrom", {})]  # fmt: skip
        return {r.rsplit("-", 1)[0] for r in refs}  # the generator's hash suffix off

    expected = {
        "kafka/kafka": set(),
        "s3/versitygw": {"tide-s3-root"},
        "s3-bucket/accounts": {"tide-s3-root", "tide-s3-trainer", "tide-s3-serving"},
        "s3-bucket/bucket": {"tide-s3-root", "tide-s3-trainer", "tide-s3-serving"},
        "postgres/postgres": {"tide-postgres"},
        "mlflow/mlflow": {"tide-postgres", "tide-s3-trainer"},
        "tide-serving/default-draft": set(),
        "tide-serving/serving": {"tide-s3-serving"},
        "tide-gate/gate": {"tide-s3-serving"},
        "tide-trainer-default/trainer": {"tide-s3-trainer"},
    }
    for overlay, docs in k8s.items():
        got = {f"{name}/{c['name']}": secrets_of(c) for name, pod in pods(docs) for c in containers(pod)}
        assert got == expected, overlay
        values = {k: v for d in docs if d["kind"] == "Secret" for k, v in d["data"].items()}
        assert "POSTGRES_PASSWORD" in values and "ROOT_SECRET_ACCESS_KEY" in values
        # the bucket job reads the trainer and serving access key ids only, not their secret keys
        bucket = next(c for name, p in pods(docs) if name == "s3-bucket" for c in p["containers"])
        assert not any("SECRET" in e["name"] and "TRAINER" in e["name"] for e in bucket["env"])


# -- the local stack -----------------------------------------------------------------------------
def test_stack_secrets_are_random_private_and_kept(tmp_path: Path) -> None:
    a = StackSecrets.load_or_create(secrets_path(tmp_path / "a"))
    b = StackSecrets.load_or_create(secrets_path(tmp_path / "b"))
    values = list(vars(a).values())
    assert len(set(values)) == len(values) and all(len(v) >= 32 for v in values)
    assert not set(values) & set(vars(b).values())
    path = secrets_path(tmp_path / "a")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert StackSecrets.load_or_create(path) == a  # made once: a restart keeps the accounts working
    path.chmod(0o644)
    assert StackSecrets.load_or_create(path) == a and stat.S_IMODE(path.stat().st_mode) == 0o600

    res = CliRunner().invoke(app, ["secrets", "--data", str(tmp_path / "a"), "--k8s", str(tmp_path / "k8s")])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == str(path)
    for env in (tmp_path / "k8s").iterdir():
        assert stat.S_IMODE(env.stat().st_mode) == 0o600, env
    postgres = (tmp_path / "k8s" / "postgres.env").read_text()
    assert postgres == f"POSTGRES_PASSWORD={a.TIDE_POSTGRES_PASSWORD}\n"


def test_stack_parts_have_no_fixed_keys_and_stay_local(tmp_path: Path) -> None:
    assert S3Server(tmp_path).secret_key != S3Server(tmp_path).secret_key  # no fixed default secret
    stack = Stack(StackConfig(tmp_path, s3=True))
    s3 = stack.s3_server()
    assert (s3.access_key, s3.secret_key) == (stack.secrets.TIDE_S3_ROOT_ACCESS_KEY,
                                              stack.secrets.TIDE_S3_ROOT_SECRET_KEY)  # fmt: skip
    assert s3.host == "127.0.0.1" and s3.users
    (tmp_path / "kafka").mkdir()
    broker = KafkaBroker(tmp_path / "kafka", port=1, controller_port=2)
    props = broker._properties().read_text()
    assert "listeners=PLAINTEXT://127.0.0.1:1,CONTROLLER://127.0.0.1:2" in props
    wide = KafkaBroker(tmp_path / "kafka", port=1, controller_port=2, host="0.0.0.0")
    assert "listeners=PLAINTEXT://0.0.0.0:1," in wide._properties().read_text()
    assert wide.bootstrap == "127.0.0.1:1"


@pytest.mark.slow  # starts a real server
def test_stack_s3_accounts_per_role(tmp_path: Path) -> None:
    """On a real versitygw: trainers write the artifact bucket, serving only reads it."""
    stack = Stack(StackConfig(tmp_path, s3=True))
    with stack.s3_server() as s3:
        stack._s3_accounts(s3)
        stack._s3_accounts(s3)  # a restart on the same data: the accounts are there already

        def client(role: str) -> Any:
            env = stack.role_env[role]
            return s3.client(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])

        trainer, serving = client("trainer"), client("serving")
        assert stack.role_env["serving"]["AWS_SECRET_ACCESS_KEY"] != s3.secret_key
        trainer.put_object(Bucket=BUCKET, Key="mlflow/draft/config.json", Body=b"{}")
        assert serving.get_object(Bucket=BUCKET, Key="mlflow/draft/config.json")["Body"].read() == b"{}"
        listed = serving.list_objects_v2(Bucket=BUCKET)["Contents"]
        assert [o["Key"] for o in listed] == ["mlflow/draft/config.json"]
        for attempt in (
            lambda: serving.put_object(Bucket=BUCKET, Key="mlflow/draft/config.json", Body=b"tampered"),
            lambda: serving.delete_object(Bucket=BUCKET, Key="mlflow/draft/config.json"),
            lambda: serving.create_bucket(Bucket="elsewhere"),
            lambda: trainer.delete_bucket_policy(Bucket=BUCKET),
        ):
            with pytest.raises(ClientError) as e:
                attempt()
            assert e.value.response["Error"]["Code"] == "AccessDenied"
        assert trainer.get_object(Bucket=BUCKET, Key="mlflow/draft/config.json")["Body"].read() == b"{}"


SERVING_NODE = """
import sys
from pathlib import Path
from mlflow import MlflowClient

url, run_id, out = sys.argv[1:]
client = MlflowClient(url)
print(Path(client.download_artifacts(run_id, "draft", out), "config.json").read_text())
try:
    client.log_artifacts(run_id, out, "tampered")
    print("uploaded")
except Exception as e:
    print(type(e).__name__, e)
"""


@pytest.mark.slow  # starts a real server
def test_stack_s3_roles_through_mlflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tide up --s3` as its parts use it: the stack registers a draft with the trainer account; a
    process with the serving account (MLflow caches its S3 client per process) downloads it and cannot
    upload one."""
    from mlflow import MlflowClient

    from tide.registry.store import register_folder

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_S3_ENDPOINT_URL", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(k, raising=False)  # the stack leaves our environment alone: accounts are per part
    stack = Stack(StackConfig(tmp_path, mlflow_port=free_port(), s3=True))
    try:
        stack.start_step("s3")
        stack.start_step("mlflow")
        draft = tmp_path / "draft"
        draft.mkdir()
        (draft / "config.json").write_text('{"draft": 1}')
        with as_account(stack.role_env["trainer"]):  # as the stack registers its starting draft
            mv = register_folder(MlflowClient(stack.registry), "fp", "default", draft)
        assert "AWS_ACCESS_KEY_ID" not in os.environ
        env = {**os.environ, **stack.role_env["serving"]}
        node = subprocess.run([sys.executable, "-c", SERVING_NODE, stack.registry, mv.run_id or "",
                               str(tmp_path / "got")], env=env, capture_output=True, text=True)  # fmt: skip
        assert node.returncode == 0, node.stderr
        lines = node.stdout.strip().splitlines()
        assert lines[0] == '{"draft": 1}'
        assert "AccessDenied" in lines[-1], lines[-1]
    finally:
        stack.stop()


AWS_CLI = """#!{python}
# `aws --endpoint-url URL s3api OP --bucket B [--policy P]`, the calls of the setup jobs, made with boto3
import sys

import boto3
from botocore.config import Config

args = sys.argv[1:]
endpoint, op, bucket = (args[args.index(flag) + 1] for flag in ("--endpoint-url", "s3api", "--bucket"))
s3 = boto3.client("s3", endpoint_url=endpoint, config=Config(s3={{"addressing_style": "path"}}))
try:
    if op == "head-bucket":
        s3.head_bucket(Bucket=bucket)
    elif op == "create-bucket":
        s3.create_bucket(Bucket=bucket)
    elif op == "put-bucket-policy":
        s3.put_bucket_policy(Bucket=bucket, Policy=args[args.index("--policy") + 1])
    else:
        sys.exit(f"unexpected: {{args}}")
except Exception as e:
    sys.exit(str(e))
"""


@pytest.mark.parametrize("where", ["compose", "k8s"])
def test_setup_jobs_make_the_accounts_and_the_policy(
    where: str, services: dict[str, dict[str, Any]], k8s: dict[str, list[dict[str, Any]]], made: StackSecrets,
    tmp_path: Path,
) -> None:  # fmt: skip
    """The S3 setup jobs' own scripts (compose's s3-accounts and s3-bucket, the k8s s3-bucket Job), run
    against a real versitygw (its admin CLI as the jobs run it; `aws` as a boto3 stand-in): the serving
    account reads the bucket and cannot write it, the trainer account writes it."""
    from tide.infra.s3.server import versitygw_binary

    if where == "compose":
        # `config` writes `$` as `$$`, so that its output loads again; compose hands the job `$`
        jobs = [(services[n]["command"][0].replace("$$", "$"), services[n]["environment"])
                for n in ("s3-accounts", "s3-bucket")]  # fmt: skip
    else:
        job = next(p for name, p in pods(k8s["base"]) if name == "s3-bucket")
        keys = {"ADMIN_ACCESS_KEY_ID": made.TIDE_S3_ROOT_ACCESS_KEY, "ADMIN_SECRET_ACCESS_KEY": made.TIDE_S3_ROOT_SECRET_KEY,
                "TRAINER_ACCESS_KEY": made.TIDE_S3_TRAINER_ACCESS_KEY, "TRAINER_SECRET_KEY": made.TIDE_S3_TRAINER_SECRET_KEY,
                "SERVING_ACCESS_KEY": made.TIDE_S3_SERVING_ACCESS_KEY, "SERVING_SECRET_KEY": made.TIDE_S3_SERVING_SECRET_KEY,
                "ADMIN_ENDPOINT_URL": "http://s3:7070", "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
        jobs = [(c["args"][0], keys) for c in containers(job)]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "aws").write_text(AWS_CLI.format(python=sys.executable))
    (bin_dir / "aws").chmod(0o755)
    (bin_dir / "versitygw").symlink_to(versitygw_binary())
    root = (made.TIDE_S3_ROOT_ACCESS_KEY, made.TIDE_S3_ROOT_SECRET_KEY)
    with S3Server(tmp_path / "s3", access_key=root[0], secret_key=root[1], users=True) as s3:
        for _ in range(2):  # a job run again (a restart) finds its work done
            for script, job_env in jobs:
                env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path)}
                env |= {k: str(v).replace("http://s3:7070", s3.endpoint_url) for k, v in job_env.items()}
                script = script.replace("http://s3:7070", s3.endpoint_url)
                res = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True)
                assert res.returncode == 0, res.stdout + res.stderr
        trainer = s3.client(made.TIDE_S3_TRAINER_ACCESS_KEY, made.TIDE_S3_TRAINER_SECRET_KEY)
        serving = s3.client(made.TIDE_S3_SERVING_ACCESS_KEY, made.TIDE_S3_SERVING_SECRET_KEY)
        trainer.put_object(Bucket="tide", Key="mlflow/x", Body=b"draft")
        assert serving.get_object(Bucket="tide", Key="mlflow/x")["Body"].read() == b"draft"
        with pytest.raises(ClientError, match="AccessDenied"):
            serving.put_object(Bucket="tide", Key="mlflow/x", Body=b"tampered")
