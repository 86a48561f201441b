"""OS isolation for code we did not write (the examples ``code.validate`` runs), with bubblewrap.

``command(argv)`` wraps a command line so that it runs:

* in new user, mount, PID, network, IPC, UTS and cgroup namespaces: no network at all (only a loopback of its
  own), no view of the worker's processes (``/proc`` is the sandbox's own), no further user namespaces;
* on a read-only view of the root file system with a private, size-capped ``/tmp`` (its working directory),
  a minimal ``/dev``, an empty ``/sys`` and no ``/root`` beyond the Python runtime itself;
* as an unprivileged uid with no capabilities and ``no_new_privs``. When the worker runs as root (development,
  CI), a privileged bwrap builds the mounts and PID/network namespaces, ``setpriv`` drops to ``SANDBOX_UID``
  (65534 unless ``LEDGERFLOW_SANDBOX_UID`` says otherwise) and an unprivileged bwrap adds the user namespace.
  The kernel then counts the example's processes against a non-root uid, so ``RLIMIT_NPROC`` holds (root's
  processes ignore it);
* with a cleared environment (``env`` is all it gets) and ``--die-with-parent``, so killing the outer process
  ends the whole sandbox (its PID namespace dies with its init).

Resource limits (CPU, memory, processes, file size, open files) are the caller's to set inside (the
codecheck bootstrap does, before the example's first line). ``status()`` says once per process whether the
sandbox really starts here, and why not (no ``bwrap`` on PATH, or namespaces refused, as under Docker's
default seccomp profile). See ``docs/sandbox.md``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "SANDBOX_TMP",
    "SandboxStatus",
    "SandboxUnavailable",
    "command",
    "runtime_non_dumpable",
    "sandbox_uid",
    "status",
]

# The sandbox's working directory and temp dir, a tmpfs private to one run.
SANDBOX_TMP = "/tmp"
TMP_SIZE = 64 * 1024 * 1024
# The uid the example runs as inside its user namespace (what `id` shows there).
INNER_ID = 1000
DEFAULT_SANDBOX_UID = 65534
_SETPRIV = "setpriv"
_PR_SET_DUMPABLE = 4


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here; the message is one line naming what is missing."""


@dataclass(frozen=True)
class SandboxStatus:
    """Whether the sandbox starts on this machine.

    Attributes:
        ok: It ran a trivial command under full isolation.
        reason: Why not, one line naming the missing tool or the refusal (empty when ok).
    """

    ok: bool
    reason: str = ""


def sandbox_uid() -> int:
    """The unprivileged uid a root worker drops to before the example runs."""
    return int(os.environ.get("LEDGERFLOW_SANDBOX_UID") or DEFAULT_SANDBOX_UID)


def command(argv: Sequence[str], env: Mapping[str, str], *, tmp_size: int = TMP_SIZE) -> list[str]:
    """Return ``argv`` wrapped to run in the sandbox with exactly ``env`` as its environment.

    Raises:
        SandboxUnavailable: No ``bwrap`` (or, as root, no ``setpriv``) on PATH.
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (`bwrap`) not found on PATH: apt-get install bubblewrap")
    setenv = [arg for name, value in env.items() for arg in ("--setenv", name, value)]
    inner_ns = ["--unshare-user", "--disable-userns", "--uid", str(INNER_ID), "--gid", str(INNER_ID)]
    common = ["--die-with-parent", "--chdir", SANDBOX_TMP]
    if os.geteuid() != 0:
        # One unprivileged bwrap does it all; its user namespace maps to the worker's own (non-root) uid.
        return [
            bwrap,
            "--unshare-all",
            *inner_ns,
            "--hostname",
            "sandbox",
            "--new-session",
            *_mounts(tmp_size, runtime_overlay=False),
            *common,
            "--clearenv",
            *setenv,
            "--",
            *argv,
        ]
    setpriv = shutil.which(_SETPRIV)
    if setpriv is None:
        raise SandboxUnavailable(
            "util-linux `setpriv` not found on PATH (needed to drop root before the sandbox)"
        )
    uid = str(sandbox_uid())
    outer = [
        bwrap,
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "sandbox",
        "--new-session",
        *_mounts(tmp_size, runtime_overlay=True),
        *common,
        "--clearenv",
        *setenv,
        "--",
    ]
    drop = [
        setpriv,
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]
    # The inner bwrap keeps the outer one's /proc (its PID namespace is the right one) and /tmp.
    inner = [
        bwrap,
        *inner_ns,
        "--ro-bind",
        "/",
        "/",
        "--bind",
        SANDBOX_TMP,
        SANDBOX_TMP,
        "--dev-bind",
        "/dev",
        "/dev",
        *common,
        "--",
    ]
    return [*outer, *drop, *inner, *argv]


def _mounts(tmp_size: int, *, runtime_overlay: bool) -> list[str]:
    mounts = ["--ro-bind", "/", "/", "--tmpfs", "/sys"]
    if runtime_overlay:
        mounts += _runtime_binds()
    mounts += [
        "--perms",
        "1777",
        "--size",
        str(tmp_size),
        "--tmpfs",
        SANDBOX_TMP,
        "--proc",
        "/proc",
        "--dev",
        "/dev",
    ]
    return mounts


def _runtime_binds() -> list[str]:
    """Hide ``/root`` behind an empty tmpfs, keeping only the Python runtime that lives under it (if any).

    An unprivileged uid cannot cross root's 0700 home, where pyenv installs Python in development; and
    nothing else of root's home (credentials, shell history) belongs in the sandbox.
    """
    home = "/root"
    binds = ["--tmpfs", home]
    runtimes = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.executable)}
    for runtime in sorted(runtimes):
        if not runtime.startswith(home + os.sep):
            continue
        if os.path.isfile(runtime):
            runtime = os.path.dirname(os.path.dirname(runtime))  # .../bin/python3.11 -> the prefix
        parts = runtime[len(home) + 1 :].split(os.sep)
        for depth in range(1, len(parts)):
            binds += ["--perms", "0755", "--dir", os.path.join(home, *parts[:depth])]
        binds += ["--ro-bind", runtime, runtime]
    return [*binds, "--remount-ro", home]


@functools.cache
def status() -> SandboxStatus:
    """Start ``true`` in the sandbox once per process, and report whether that worked."""
    try:
        argv = command(["/bin/true"], {"PATH": "/usr/bin:/bin"})
    except SandboxUnavailable as e:
        return SandboxStatus(ok=False, reason=str(e))
    try:
        done = subprocess.run(
            argv, capture_output=True, timeout=30, check=False, env={}, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return SandboxStatus(ok=False, reason=f"bubblewrap (`bwrap`) did not start: {e}")
    if done.returncode != 0:
        said = done.stderr.decode("utf-8", "replace").strip().splitlines()
        detail = said[-1] if said else f"exit status {done.returncode}"
        return SandboxStatus(
            ok=False, reason=f"bubblewrap (`bwrap`) cannot create its namespaces here: {detail}"
        )
    return SandboxStatus(ok=True)


def runtime_non_dumpable() -> None:
    """Mark this process non-dumpable: its ``/proc/<pid>/environ``, ``mem`` and ``fd`` close to other
    processes of the same uid (anything it starts, should one escape its sandbox); no core file either.

    Call once at worker start-up, before the first example or probe runs. Linux only; a no-op elsewhere.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_DUMPABLE, 0) failed: {os.strerror(err)}")
