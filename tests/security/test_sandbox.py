"""Issue 24 §2: a lesson's examples (code an LLM wrote) run in a real sandbox.

Each test is one attack an example can make; each must end as that example's failure with a clear reason,
never as a leak, a worker crash or a process that outlives the check. They run as the worker does in
development and CI: as root (the process limit must hold there too).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vendors import sandbox
from vendors.codecheck import SandboxUnavailable, check_markdown

REPO = Path(__file__).resolve().parents[2]


def lesson(*blocks: str) -> str:
    parts = ["# Lesson", ""]
    for n, code in enumerate(blocks):
        parts += [f"Step {n}:", "", "```python", textwrap.dedent(code).strip("\n"), "```", ""]
    return "\n".join(parts)


@pytest.fixture
def listener() -> Iterator[tuple[int, list[tuple[str, int]]]]:
    """A TCP listener on 127.0.0.1 (the host's loopback) recording every connection it accepts."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.1)
    accepted: list[tuple[str, int]] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, peer = server.accept()
            except TimeoutError:
                continue
            accepted.append(peer)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join()
        server.close()


def test_an_example_cannot_read_the_workers_environment() -> None:
    """A worker with secrets in its real environment runs an example that reads every /proc/<pid>/environ
    it can, the worker's own pid included, and prints the secrets it found reversed (past any scrubbing)."""
    pg_password, vendor_key = f"pg-{secrets.token_hex(8)}", f"vk-{secrets.token_hex(8)}"
    example = """
        import os, sys
        found = []
        for pid in sorted({os.getppid(), WORKER_PID, *(int(p) for p in os.listdir("/proc") if p.isdigit())}):
            try:
                environ = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
            except OSError as e:
                found.append(f"{pid}: {e.strerror}")
            else:
                found += [kv[::-1] for kv in environ.split(chr(0)) if "PASSWORD" in kv or "KEY" in kv]
        sys.exit("FOUND " + " | ".join(found))
        """
    worker = textwrap.dedent(
        f"""
        import asyncio, json, os
        from vendors.codecheck import check_markdown
        markdown = {lesson(example)!r}.replace("WORKER_PID", str(os.getpid()))
        report = asyncio.run(check_markdown(markdown, timeout_s=10))
        print(json.dumps(report.to_json()))
        """
    )
    env = {
        "PATH": os.environ["PATH"],
        "PGPASSWORD": pg_password,
        "LEDGERFLOW_VENDOR_KEY": vendor_key,
        "LEDGERFLOW_ENV": "production",  # no fallback: without a sandbox this raises rather than leaks
    }
    done = subprocess.run(
        [sys.executable, "-c", worker],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    [failure] = report["failures"]
    assert failure["kind"] == "error"
    assert "FOUND" in failure["message"]
    for secret in (pg_password, vendor_key):
        assert secret not in done.stdout
        assert secret[::-1] not in done.stdout


async def test_sockets_reach_no_listener_directly_through_libc_or_through_a_subprocess(
    listener: tuple[int, list[tuple[str, int]]],
) -> None:
    port, accepted = listener
    markdown = lesson(
        # The audit hook's business (an in-process guard).
        f"""
        import socket
        socket.create_connection(("127.0.0.1", {port}), timeout=2)
        """,
        # libc directly: no audit event, only the kernel can refuse.
        f"""
        import ctypes, ctypes.util, os, socket, struct
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
        if fd < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        address = struct.pack("!HH4s8x", socket.AF_INET, {port}, socket.inet_aton("127.0.0.1"))
        address = struct.pack("=H", socket.AF_INET) + address[2:]
        if libc.connect(fd, address, len(address)) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        """,
        # Another interpreter: no hook at all.
        f"""
        import subprocess, sys
        connect = "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"
        subprocess.run([sys.executable, "-c", connect], check=True)
        """,
    )

    report = await check_markdown(markdown, timeout_s=10)

    time.sleep(0.3)  # a connection that got through is accepted by now
    assert accepted == []
    assert [(f.index, f.kind) for f in report.failures] == [(0, "error"), (1, "error"), (2, "error")]
    assert "network access is blocked" in report.failures[0].message
    assert report.failures[1].message.endswith("ConnectionRefusedError: [Errno 111] Connection refused")
    assert "ConnectionRefusedError: [Errno 111] Connection refused" in report.failures[2].message


async def test_the_process_limit_holds_for_a_root_worker() -> None:
    """100 short-lived children: fine for the kernel, but past the limit; the example fails, naming it."""
    assert os.geteuid() == 0, "this test is about a worker running as root, as in development and CI"
    markdown = lesson(
        """
        import subprocess
        children = [subprocess.Popen(["sleep", "2"]) for _ in range(100)]
        for child in children:
            child.wait()
        """
    )

    report = await check_markdown(markdown, timeout_s=10)

    [failure] = report.failures
    assert failure.kind == "error"
    assert failure.message.startswith("exceeded the process limit of 64 processes\n")
    assert failure.message.endswith("BlockingIOError: [Errno 11] Resource temporarily unavailable")


async def test_a_fork_bomb_is_contained_and_ends_with_its_example() -> None:
    markdown = lesson(
        """
        import os
        while True:
            os.fork()
        """
    )

    started = time.monotonic()
    report = await check_markdown(markdown, timeout_s=5)

    assert time.monotonic() - started < 5
    [failure] = report.failures
    assert failure.kind == "error"
    assert failure.message.startswith("exceeded the process limit of 64 processes\n")
    await _gone(lambda: _sandboxed_processes() == [])


async def test_writing_outside_the_private_tmp_fails_and_leaves_nothing() -> None:
    targets = [
        REPO / f".sandbox-escape-{secrets.token_hex(4)}",
        Path(f"/etc/sandbox-escape-{secrets.token_hex(4)}"),
    ]
    markdown = lesson(
        *(f"open({str(t)!r}, 'w').write('owned')" for t in targets),
        "open('/tmp/scratch.txt', 'w').write('fine')",  # its own tmp is writable
    )
    try:
        report = await check_markdown(markdown, timeout_s=10)
    finally:
        leaked = [t for t in targets if t.exists()]
        for t in leaked:
            t.unlink()

    assert leaked == []
    assert [(f.index, f.kind) for f in report.failures] == [(0, "error"), (1, "error")]
    for failure in report.failures:
        assert failure.message.endswith("Read-only file system: " + repr(str(targets[failure.index])))


async def test_sleeping_forever_times_out_and_leaves_no_process() -> None:
    marker = f"{4000 + secrets.randbelow(10**6) / 10**6:.6f}"
    markdown = lesson(
        f"""
        import subprocess, time
        subprocess.Popen(["sleep", "{marker}"], start_new_session=True)  # leaves our process group
        time.sleep(10**9)
        """
    )

    started = time.monotonic()
    report = await check_markdown(markdown, timeout_s=1)

    assert time.monotonic() - started < 3
    [failure] = report.failures
    assert (failure.kind, failure.message) == ("timeout", "timed out after 1s")
    await _gone(lambda: _host_processes(f"sleep\0{marker}") == [])


async def test_allocating_10_gb_is_a_memory_failure() -> None:
    report = await check_markdown(lesson("data = bytearray(10 * 1024**3)"), memory_mb=256)

    [failure] = report.failures
    assert failure.kind == "memory"
    assert failure.message.startswith("exceeded the memory limit of 256 MiB")


async def test_secrets_are_scrubbed_from_failure_texts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lesson itself carries the worker's secrets (an LLM echoed them): none reaches the report."""
    values = {
        "PGPASSWORD": f"pg-{secrets.token_hex(6)}",
        "LEDGERFLOW_VENDOR_KEY": f"vk-{secrets.token_hex(6)}",
        "LEDGERFLOW_REVIEW_SECRET": f"rs-{secrets.token_hex(6)}",
        "GITHUB_TOKEN": f"gh-{secrets.token_hex(6)}",
    }
    db_password = f"db-{secrets.token_hex(6)}"
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LEDGERFLOW_DATABASE_URL", f"postgresql://ledger:{db_password}@127.0.0.1:5432/ledger")
    leaked = [*values.values(), db_password]
    markdown = lesson(
        f"raise RuntimeError({' '.join(leaked)!r})", f"print({leaked!r}); import sys; sys.exit(2)"
    )

    report = await check_markdown(markdown, timeout_s=10)

    assert [f.kind for f in report.failures] == ["error", "error"]
    text = json.dumps(report.to_json())
    assert not [value for value in leaked if value in text]
    assert report.failures[0].message.endswith("RuntimeError: " + " ".join(["[redacted]"] * 5))


@pytest.fixture
def no_bwrap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no bwrap on PATH
    sandbox.status.cache_clear()
    yield
    sandbox.status.cache_clear()


@pytest.mark.usefixtures("no_bwrap")
async def test_without_a_sandbox_code_validate_refuses_outside_dev_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LEDGERFLOW_ENV", "production")

    with pytest.raises(SandboxUnavailable) as refused:
        await check_markdown(lesson("print('hello')"), timeout_s=5)

    message = str(refused.value)
    assert "\n" not in message
    assert message == (
        "code.validate refuses to run examples without a sandbox: "
        "bubblewrap (`bwrap`) not found on PATH: apt-get install bubblewrap"
    )


@pytest.mark.usefixtures("no_bwrap")
async def test_without_a_sandbox_dev_mode_runs_with_a_loud_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("LEDGERFLOW_ENV", "dev")

    with caplog.at_level(logging.WARNING, logger="vendors.codecheck"):
        report = await check_markdown(lesson("print('hello')"), timeout_s=5)

    assert report.ok
    [record] = [r for r in caplog.records if r.name == "vendors.codecheck"]
    assert record.levelno == logging.WARNING
    assert "NO SANDBOX" in record.getMessage()
    assert "`bwrap`" in record.getMessage()


def _host_processes(cmdline_prefix: str) -> list[int]:
    """Host pids of live (non-zombie) processes whose NUL-separated command line starts with the prefix."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if argv.startswith(cmdline_prefix.encode()) and state != "Z":
            found.append(int(entry.name))
    return found


def _sandboxed_processes() -> list[int]:
    """Live processes of the sandbox's uid running our bootstrap (what a fork bomb's children are)."""
    uid = sandbox.sandbox_uid()
    found = []
    for pid in _host_processes(""):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
        if str(uid) in uids and b"_codecheck_main" in cmdline:
            found.append(pid)
    return found


async def _gone(check: object, within: float = 3.0) -> None:
    """SIGKILL is asynchronous: wait until ``check()`` holds (the PID namespace has emptied)."""
    assert callable(check)
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "processes outlived their example"
        await asyncio.sleep(0.05)


def test_a_non_dumpable_worker_closes_its_environ_to_what_it_starts(tmp_path: Path) -> None:
    """``runtime_non_dumpable`` in an unprivileged worker (root reads any environ regardless: that is what
    the sandbox's uid drop is for): a child of the same uid reads the secret before, and not after."""
    assert os.geteuid() == 0, "starts an unprivileged worker with setpriv"
    secret = f"pg-{secrets.token_hex(8)}"
    worker = textwrap.dedent(
        f"""
        import subprocess, sys
        sys.path.insert(0, {str(REPO)!r})
        from vendors.sandbox import runtime_non_dumpable

        def child_reads():
            read = "import os; print(open(f'/proc/{{os.getppid()}}/environ').read())"
            done = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True)
            return done.stdout + done.stderr

        print("BEFORE", child_reads())
        runtime_non_dumpable()
        print("AFTER", child_reads())
        """
    )
    done = as_unprivileged_worker(worker, {"PATH": "/usr/bin:/bin", "PGPASSWORD": secret}, 30, cwd=tmp_path)

    assert done.returncode == 0, done.stderr
    before, after = done.stdout.split("AFTER", 1)
    assert secret in before
    assert secret not in after
    assert "PermissionError: [Errno 13] Permission denied" in after


def test_an_unprivileged_worker_gets_the_same_sandbox() -> None:
    """The image's worker is not root: then one unprivileged bwrap builds every namespace itself."""
    assert os.geteuid() == 0, "starts an unprivileged worker with setpriv"
    example = """
        import os, sys
        print(os.getuid(), os.getpid(), file=sys.stderr)
        open("/etc/owned", "w")
        """
    worker = textwrap.dedent(
        f"""
        import asyncio, json, sys
        sys.path.insert(0, {str(REPO)!r})
        from vendors.codecheck import check_markdown
        print(json.dumps(asyncio.run(check_markdown({lesson(example)!r}, timeout_s=10)).to_json()))
        """
    )
    done = as_unprivileged_worker(worker, {"PATH": os.environ["PATH"], "LEDGERFLOW_ENV": "production"}, 60)

    assert done.returncode == 0, done.stderr
    [failure] = json.loads(done.stdout)["failures"]
    # uid 1000 of its own user namespace, pid 2 of its own PID namespace (bwrap's init is 1), read-only root.
    assert failure["message"].startswith(f"{sandbox.INNER_ID} 2\n")
    assert failure["message"].endswith("OSError: [Errno 30] Read-only file system: '/etc/owned'")


def as_unprivileged_worker(
    code: str, env: dict[str, str], timeout: float, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as a worker would that is not root: the system Python (an unprivileged uid may not reach
    the venv's interpreter, under /root) as the sandbox's uid, no groups."""
    uid = str(sandbox.sandbox_uid())
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", "/usr/bin/python3", "-I"]
    return subprocess.run(
        [*argv, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
