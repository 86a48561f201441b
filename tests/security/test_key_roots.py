"""Issue 24 §3 (its optional part): approver keys endorsed by an offline root key.

Whoever holds the operator's database credentials may register approver keys — that is the role's job — so
without more they can register a key of their own under a real approver's name and sign any decision with
it: the worker accepts it and the audit finds nothing wrong. A deployment that sets ``LEDGERFLOW_KEY_ROOTS``
(root public keys) trusts only registry entries a root key endorsed; the root's private half stays offline
(the ceremony: ``ledgerflow keys root-generate``, ``entry``, ``endorse``, ``add-endorsement``;
docs/operations.md).
Both the worker (when it rules) and ``ledgerflow audit`` (when it re-verifies) check the endorsement.

End to end on the real servers, the ceremony through the CLI as an operator and a root custodian would run it.
"""

from __future__ import annotations

import json
import uuid

import pytest
import sqlalchemy as sa
from peoplekit import cli, wait_open

from ledger import roles
from ledger.recorder import Recorder
from ledgerflow.views import people
from ledgerflow.views.audit import audit
from rules.approvers import KeyRecord, endorsement_message
from runtime.settings import ConfigError, Settings
from runtime.signing import demo_key, generate, load_key_file

APPROVAL = """
goal: a storyboard a person must approve
budget_ceiling: 10
approval: {timeout: 1h, policy: escalate}
stages:
  - {id: board, executor: llm.text, estimate: 1, approval: true}
"""
NOT_ENDORSED = "is not endorsed by a root key (LEDGERFLOW_KEY_ROOTS)"


def operator_recorder(pg_url: str) -> Recorder:
    """The ledger as the operator's login sees it (``ledgerflow db roles``' lf_operator)."""
    password = "operator-password-for-roots-0123"
    roles.ensure_logins(pg_url, {roles.ENV["operator"]: password})
    url = sa.engine.make_url(pg_url).set(username=roles.USERS["operator"], password=password)
    return Recorder(url.render_as_string(hide_password=False), pool_size=1)


def minted(pg_url: str) -> tuple[str, object]:
    """What an operator credential holder can do on their own: register a key of their own as the director."""
    key = generate("director", f"mallory-{uuid.uuid4().hex[:8]}")
    rec = operator_recorder(pg_url)
    try:
        record = KeyRecord(key_id=key.key_id, approver="director", public_key=key.public_key)
        rec.add_key(record, actor="mallory", reason="looks routine")
    finally:
        rec.dispose()
    return key.key_id, key


async def open_approval(lf):
    plan = lf.plan(APPROVAL)
    handle = await lf.start(plan)
    return plan.task_id, handle, await wait_open(lf, plan.task_id, "approval:board")


async def test_with_roots_set_a_key_an_operator_minted_decides_nothing_and_fails_the_audit(
    lf_with, sim, pg_url
):
    root = generate("root", "root-test")
    kid, mallory = minted(pg_url)
    # Without roots (as before): the minted key's decision is accepted, and only roots let the audit see it.
    async with lf_with() as lf:
        task_id, handle, rid = await open_approval(lf)
        sent = await people.decide(lf.settings, mallory, task_id, rid, "approve")
        assert sent.status == "accepted"
        await handle.result()
        rooted = lf.settings.model_copy(update={"key_roots": root.public_key})
        report = await audit(rooted, lf.recorder, lf.client, [task_id])
        [problem] = report.tasks[0].problems()
        assert problem.endswith(f"approve by director: key {kid} {NOT_ENDORSED}")
    # With roots: the worker refuses it on record, naming why; so too a registered but unendorsed demo key.
    async with lf_with(key_roots=root.public_key) as lf:
        task_id, handle, rid = await open_approval(lf)
        sent = await people.decide(lf.settings, mallory, task_id, rid, "approve")
        assert (sent.status, sent.detail) == ("rejected", f"key {kid} {NOT_ENDORSED}")
        demo = await people.decide(lf.settings, demo_key("director"), task_id, rid, "approve")
        assert (demo.status, demo.detail) == ("rejected", f"key demo-director {NOT_ENDORSED}")
        await handle.cancel()


async def test_the_ceremony_endorses_a_key_that_then_decides_and_passes_the_audit(
    lf_with, sim, tmp_path, pg_url
):
    kid = f"alice-{uuid.uuid4().hex[:8]}"
    offline, online = tmp_path / "offline", tmp_path / "online"
    offline.mkdir()
    online.mkdir()
    async with lf_with() as plain:  # the CLI's own servers; the roots are the workers' configuration
        run = lambda *args, **env: cli(plain, online, *args, env=env)  # noqa: E731
        code, said, _ = await run(
            "keys", "root-generate", "--key-id", "root-2026", "--out", str(offline / "root.key")
        )
        assert code == 0 and "root public key" in said
        root = json.loads((offline / "root.key").read_text())["public_key"]
        code, _, _ = await run(
            "keys", "generate", "--approver", "director", "--key-id", kid, "--out", str(online / "alice.key")
        )
        assert code == 0
        scoped = ("--scope", "*")
        code, _, err = await run(
            "keys",
            "add",
            "--key-file",
            str(online / "alice.key"),
            *scoped,
            "--as",
            "ops",
            "--reason",
            "new director",
        )
        assert code == 0, err
        code, said, err = await run("keys", "entry", kid, "--out", str(online / "entry.json"))
        assert code == 0 and f"key {kid} of director" in said, err
        # The custodian carries entry.json to the offline machine, reads what it grants, and signs it there.
        code, said, err = await run(
            "keys",
            "endorse",
            str(online / "entry.json"),
            "--root-key",
            str(offline / "root.key"),
            "--out",
            str(offline / "endorsement.json"),
            LEDGERFLOW_DATABASE_URL="postgresql+psycopg://nobody@127.0.0.1:1/none",  # no database needed
        )
        assert code == 0 and "scopes *" in said, err
        # An endorsement altered on the way back (a narrower entry swapped for a wider one) is refused.
        forged = json.loads((offline / "endorsement.json").read_text())
        forged["entry"]["kinds"] = []
        forged["entry"]["scopes"] = ["project:other"]
        (online / "forged.json").write_text(json.dumps(forged))
        code, _, err = await run(
            "keys", "add-endorsement", str(online / "forged.json"), "--as", "ops", "--reason", "x"
        )
        assert code == 2 and err.strip().endswith(
            "the signature is not the root's over this entry (altered or truncated)"
        )
        code, said, err = await run(
            "keys",
            "add-endorsement",
            str(offline / "endorsement.json"),
            "--as",
            "ops",
            "--reason",
            "ceremony 12",
            LEDGERFLOW_KEY_ROOTS=root,
        )
        assert code == 0 and said.startswith(f"key {kid} of director endorsed by root {root[:16]}"), err
    alice = load_key_file(online / "alice.key")
    async with lf_with(key_roots=root) as lf:
        task_id, handle, rid = await open_approval(lf)
        sent = await people.decide(lf.settings, alice, task_id, rid, "approve")
        assert (sent.status, sent.detail) == ("accepted", "approve by director")
        assert (await handle.result()).state == "Completed"
        report = await audit(lf.settings, lf.recorder, lf.client, [task_id])
        assert report.tasks[0].problems() == []


async def test_an_endorse_row_an_operator_makes_up_endorses_nothing(lf_with, sim, pg_url):
    root, other_root = generate("root", "root-a"), generate("root", "root-b")
    kid, mallory = minted(pg_url)
    rec = operator_recorder(pg_url)
    try:
        entry = rec.key_registry()[kid].entry()
        # Signed by a root the deployment does not trust, and a made-up signature under its real root.
        rec.endorse_key(
            kid, other_root.public_key, other_root.sign(endorsement_message(entry)), actor="m", reason=""
        )
        rec.endorse_key(kid, root.public_key, "ab" * 64, actor="mallory", reason="")
    finally:
        rec.dispose()
    async with lf_with(key_roots=root.public_key) as lf:
        task_id, handle, rid = await open_approval(lf)
        sent = await people.decide(lf.settings, mallory, task_id, rid, "approve")
        assert (sent.status, sent.detail) == ("rejected", f"key {kid} {NOT_ENDORSED}")
        await handle.cancel()


async def test_a_worker_with_a_malformed_root_list_does_not_start(lf_with):
    with pytest.raises(ConfigError, match=r"^LEDGERFLOW_KEY_ROOTS: 'abc' is not a root public key"):
        async with lf_with(key_roots="abc"):
            pass


def test_a_malformed_root_list_is_one_line(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^LEDGERFLOW_KEY_ROOTS: 'nope' is not a root public key \(64 hex digits\)$"
    ):
        Settings(state_dir=tmp_path, key_roots="nope").root_keys()
    assert Settings(state_dir=tmp_path, key_roots=f" {'A' * 64} ,").root_keys() == frozenset({"a" * 64})
