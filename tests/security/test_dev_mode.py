"""Issue 24 §7: dev mode is decided at process start, from the environment (LEDGERFLOW_ENV=dev) only.

A ``.ledgerflow/stack.json`` dropped in a process's working directory used to switch dev mode on: a worker
then accepted decisions signed with the demo approvers' keys (their seeds are public) and the reviewer page
took its login tokens from the file. Now a file turns nothing on. The embedded stack passes LEDGERFLOW_ENV=dev
to what it starts; the CLI learns dev mode from the stack it talks to — the ledger's approver registry holds
the demo keys only in a dev stack — so ``ledgerflow decide --as`` keeps working in the demo.

Each process here is a real one, started without LEDGERFLOW_ENV (the test session runs in dev mode: it is
taken out of their environment), against the session's real Postgres.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from ledger.recorder import Recorder

ROOT = Path(__file__).resolve().parents[2]
CLI = [str(Path(sys.executable).parent / "ledgerflow")]
TOKENS = {"director": "t" * 24}


def production_env(**extra: str) -> dict[str, str]:
    """The environment of a process started without LEDGERFLOW_ENV (production), with real-looking keys."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGERFLOW_")}
    env.update(
        LEDGERFLOW_VENDOR_API_KEY="sk-live-not-the-simulators",
        LEDGERFLOW_LLM_API_KEY="sk-live-not-the-simulators-either",
        PYTHONPATH=str(ROOT),
        **extra,
    )
    return env


def drop_stack_json(cwd: Path, database_url: str) -> None:
    """What an attacker with write access to a working directory leaves there."""
    state = cwd / ".ledgerflow"
    state.mkdir()
    stack = {"env": "dev", "review_tokens": TOKENS, "database_url": database_url}
    (state / "stack.json").write_text(json.dumps(stack))


def run(code: str, cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def ledger_without_demo_keys(pg_url: str) -> Iterator[str]:
    """A second ledger database on the session's server, migrated, with no key registered (production's)."""
    name = f"lf_prod_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = make_url(pg_url).set(database=name).render_as_string(hide_password=False)
    rec = Recorder(url, pool_size=1)
    try:
        rec.create_schema()
        rec.dispose()
        yield url
    finally:
        rec.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_a_dropped_stack_json_does_not_make_a_worker_accept_demo_keys(
    tmp_path: Path, pg_url: str, recorder: Recorder
) -> None:
    """The session's ledger registers the demo keys (it is a dev stack's); a worker started without
    LEDGERFLOW_ENV beside a dropped stack.json saying ``env: dev`` still refuses them: it will not start."""
    drop_stack_json(tmp_path, pg_url)
    code = (
        "from runtime.settings import Settings, ConfigError\n"
        "from ledger.recorder import Recorder\n"
        "from worker import refuse_dev_secrets\n"
        "s = Settings()\n"
        "rec = Recorder(s.resolved_database_url(), pool_size=1)\n"
        "try:\n"
        "    refuse_dev_secrets(s, rec)\n"
        "    print('dev', s.dev, 'started')\n"
        "except ConfigError as e:\n"
        "    print('dev', s.dev, 'refused:', e)\n"
    )
    said = run(code, tmp_path, production_env())
    assert said.startswith("dev False refused: the approver key registry holds demo keys (demo-"), said


def test_a_dropped_stack_json_gives_the_reviewer_page_no_login_tokens(tmp_path: Path, pg_url: str) -> None:
    drop_stack_json(tmp_path, pg_url)
    code = "from runtime.settings import Settings\nprint(Settings().review_token_map())\n"
    assert run(code, tmp_path, production_env()) == "{}"


def test_the_cli_signs_as_a_demo_approver_for_a_stack_whose_ledger_registers_the_demo_keys(
    tmp_path: Path, pg_url: str, recorder: Recorder
) -> None:
    """The demo's ``ledgerflow decide … --as director``: the CLI, started without LEDGERFLOW_ENV beside the
    stack's stack.json, learns dev mode from the ledger it talks to."""
    drop_stack_json(tmp_path, pg_url)
    done = sign_as_director(tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["approver"] == "director"


def test_a_dropped_stack_json_naming_a_production_ledger_gives_the_cli_no_demo_key(
    tmp_path: Path, ledger_without_demo_keys: str
) -> None:
    drop_stack_json(tmp_path, ledger_without_demo_keys)
    done = sign_as_director(tmp_path)
    assert done.returncode != 0
    assert "no key to sign with: pass --key-file" in done.stderr, done.stderr


def sign_as_director(cwd: Path) -> subprocess.CompletedProcess[str]:
    """``ledgerflow sign … --as director`` from ``cwd``, started without LEDGERFLOW_ENV (the demo's way)."""
    return subprocess.run(
        [*CLI, "sign", "t-demo/approval:board", "approve", "--as", "director"],
        cwd=cwd,
        env=production_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
