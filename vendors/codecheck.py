"""Run the Python code examples of a Markdown lesson in a sandbox and report which fail, and why.

A generated programming lesson is only worth paying for if its examples really run. ``check_markdown``
extracts every fenced ``python`` / ``py`` block and runs each one in its own interpreter. The code is an
LLM's, so it is treated as hostile: each example runs under OS isolation (``vendors.sandbox``, bubblewrap;
``docs/sandbox.md``):

* new user, mount, PID, network, IPC and UTS namespaces: no network at all, no view of the worker's
  processes (so no ``/proc/<worker>/environ``), a read-only root and a private, size-capped ``/tmp`` that
  is its working directory, ``HOME`` and ``TMPDIR``; an unprivileged uid (a root worker drops to
  ``LEDGERFLOW_SANDBOX_UID``, 65534 by default, first) with no capabilities;
* ``sys.executable -I`` (isolated mode), as ``__main__`` from ``/tmp/example_<index>.py`` (its source comes
  on stdin, which is then ``/dev/null``), with an environment built from scratch (``PATH``, ``LANG``,
  ``HOME``, ``TMPDIR``, ``MALLOC_ARENA_MAX``) and no inherited descriptor beyond stdout and stderr, which are
  captured, keeping at most 64 KiB of each (the tail, where the traceback is);
* resource limits applied by a small bootstrap before the example's first line runs: ``RLIMIT_AS``
  (memory; address space, so a ceiling rather than resident memory), ``RLIMIT_CPU`` (slightly above the
  wall-clock timeout), ``RLIMIT_NPROC`` (processes and threads; it holds because the uid is not root),
  ``RLIMIT_NOFILE``, ``RLIMIT_FSIZE`` and no core dumps, soft equal to hard (and the ``resource.setrlimit``
  audit events refused);
* a wall-clock timeout that kills the sandbox's outer process, and with it the PID namespace: nothing an
  example starts outlives it, not even a child that started its own session;
* inside, as defence in depth and for a clear message, an audit hook that refuses non-Unix sockets and
  name lookups ("network access is blocked in code examples").

Every failure text is scrubbed of the worker's secrets (``scrub``) before it leaves this module. Without a
working sandbox (no ``bwrap``, or namespaces refused) ``run_examples`` raises ``SandboxUnavailable`` with
one line naming the missing tool, unless ``LEDGERFLOW_ENV=dev``: then it logs a loud warning and runs the
examples as before the sandbox existed (the worker's uid, a fresh temp dir, the same limits but the
process limit, the audit hook as the only network guard).

An example fails when its interpreter exits non-zero, and also when one of its threads died of an uncaught
exception (Python prints that and still exits 0, but the lesson's reader would see a traceback).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from vendors.sandbox import SANDBOX_TMP, SandboxUnavailable
from vendors.sandbox import command as sandbox_command
from vendors.sandbox import status as sandbox_status

log = logging.getLogger(__name__)

__all__ = [
    "CodeCheckReport",
    "Example",
    "ExampleFailure",
    "ExampleFailureKind",
    "SandboxUnavailable",
    "check_markdown",
    "extract_examples",
    "run_examples",
    "scrub",
]

ExampleFailureKind = Literal["error", "timeout", "memory"]

RUNNABLE_LANGUAGES = frozenset({"python", "py"})
NO_RUN_MARKER = "no-run"

# Output kept per stream; anything beyond it is read and dropped (the tail is kept: tracebacks come last).
OUTPUT_LIMIT = 64 * 1024
TRACEBACK_LINES = 40
MESSAGE_CHARS = 4000
# Plenty for a lesson; small enough that a runaway loop opening or writing files fails early.
NOFILE_LIMIT = 128
# Processes and threads of one example (inside the sandbox only: outside it the count is the worker's uid's).
NPROC_LIMIT = 64
FSIZE_LIMIT = 16 * 1024 * 1024
# After the child is gone, how long its pipes may take to reach EOF. Only a grandchild that left the process
# group (setsid) can hold them open longer; we then stop reading rather than wait for it.
PIPE_GRACE_S = 2.0
# The bootstrap's exit status when the example died of MemoryError (the exception type is known exactly
# there, whereas the parent would have to guess from text). An example calling sys.exit(86) is misreported.
MEMORY_EXIT = 86
# Fixed rather than inherited: the parent's PATH may name private tool directories, and a fixed one makes
# runs reproducible across workers.
CHILD_PATH = "/usr/local/bin:/usr/bin:/bin"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_LINE_BREAK = re.compile(r"\r\n|\r|\n")

# Run by ``python -I -c`` before the example.
# argv = [path, memory_bytes, cpu_s, nofile, fsize, sandbox, memory_exit, nproc]; the source on stdin.
# Everything it needs is imported and bound to locals before user code runs, so an example that
# monkeypatches ``os`` or ``socket`` cannot change what the hook checks against.
_BOOTSTRAP = r"""
import sys


def _codecheck_main(argv):
    import atexit
    import errno
    import os
    import resource
    import socket
    import threading
    import traceback
    import types

    path, sandbox = argv[1], argv[6]
    memory, cpu, nofile, fsize, memory_exit, nproc = map(int, argv[2:6] + argv[7:9])

    # The example arrives on stdin (the sandbox's /tmp is private: nothing of ours can be put there); stdin
    # is then /dev/null, and no other descriptor of the parent's survives.
    source_code = sys.stdin.buffer.read()
    with open(path, "wb") as target:
        target.write(source_code)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.closerange(3, 65536)

    def limit(which, value, hard=None):
        hard = value if hard is None else hard
        _, current_hard = resource.getrlimit(which)
        if current_hard != resource.RLIM_INFINITY:
            value, hard = min(value, current_hard), min(hard, current_hard)
        resource.setrlimit(which, (value, hard))

    limit(resource.RLIMIT_AS, memory)
    # SIGXCPU at the soft limit, SIGKILL at the hard one.
    limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    limit(resource.RLIMIT_NOFILE, nofile)
    limit(resource.RLIMIT_FSIZE, fsize)
    limit(resource.RLIMIT_CORE, 0)
    # Counted per uid: without a sandbox as root it is ignored (root is exempt), inside it the example is an
    # unprivileged uid of its own user namespace, and a fork bomb stops here.
    if nproc:
        limit(resource.RLIMIT_NPROC, nproc)

    af_unix = socket.AF_UNIX
    realpath, join, fsdecode, getcwd = os.path.realpath, os.path.join, os.fsdecode, os.getcwd
    root = realpath(sandbox)
    root_prefix = root + os.sep
    lookups = frozenset(
        {"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"}
    )
    endpoints = frozenset({"socket.connect", "socket.bind"})
    limits = frozenset({"resource.setrlimit", "resource.prlimit"})

    def blocked(what):
        return PermissionError(
            errno.EPERM, f"network access is blocked in code examples ({what}); mark the block python no-run"
        )

    def local_unix_path(address):
        if isinstance(address, bytes):
            address = fsdecode(address)
        # An empty or NUL-prefixed name is Linux's abstract namespace: shared with the host, so not local.
        if not isinstance(address, str) or not address or address.startswith("\0"):
            return False
        resolved = realpath(join(getcwd(), address))
        return resolved == root or resolved.startswith(root_prefix)

    def _codecheck_guard(event, args):
        if event == "socket.__new__":
            if args[1] != af_unix:
                raise blocked("socket")
        elif event in endpoints:
            if not local_unix_path(args[1]):
                raise blocked(event.removeprefix("socket.") + " " + repr(args[1]))
        elif event in lookups:
            raise blocked(event.removeprefix("socket.") + " " + repr(args[0]))
        elif event in limits:
            raise PermissionError(errno.EPERM, "resource limits are fixed while checking code examples")

    sys.addaudithook(_codecheck_guard)

    # An uncaught exception in a thread is printed but leaves the exit status 0; an example whose thread
    # crashed is still broken, so remember it and fail the run once the thread has been joined.
    thread_failures = []
    print_thread_failure = threading.excepthook

    def _codecheck_thread_failed(args):
        thread_failures.append(args.exc_type)
        print_thread_failure(args)

    threading.excepthook = _codecheck_thread_failed
    main_returned = []

    def _codecheck_exit():
        # atexit handlers run after the interpreter joined the non-daemon threads, and this one, registered
        # first, runs last.
        if main_returned and thread_failures:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(memory_exit if issubclass(thread_failures[0], MemoryError) else 1)

    atexit.register(_codecheck_exit)

    # Run the example the way ``python example.py`` would: as __main__, with its directory on sys.path.
    sys.argv = [path]
    sys.path.insert(0, os.path.dirname(path))
    main = types.ModuleType("__main__")
    main.__file__ = path
    sys.modules["__main__"] = main
    status = 0
    try:
        with open(path, "rb") as source:
            code = compile(source.read(), path, "exec", dont_inherit=True)
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        status = memory_exit if isinstance(exc, MemoryError) else 1
        tb = exc.__traceback__
        # Drop this bootstrap's frames: the report shows the example's traceback only.
        while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
            tb = tb.tb_next
        # What filled the memory is usually still referenced, so even the traceback may not fit: the status
        # above is what counts.
        try:
            traceback.print_exception(type(exc), exc, tb)
        except MemoryError:
            pass
    else:
        main_returned.append(True)
    sys.exit(status)


_codecheck_main(sys.argv)
"""


@dataclass(frozen=True)
class Example:
    """One runnable code block of a lesson.

    Attributes:
        index: 0-based position among the lesson's runnable blocks (``no-run`` blocks are not counted).
        code: The block's content, with the opening fence's indentation removed.
        line: 1-based line of the opening fence in the Markdown source.
    """

    index: int
    code: str
    line: int


@dataclass(frozen=True)
class ExampleFailure:
    """Why one example did not run cleanly.

    Attributes:
        index: The example's ``Example.index``.
        line: The example's opening fence line in the Markdown source.
        kind: ``"error"`` (non-zero exit), ``"timeout"`` (wall-clock or CPU limit) or ``"memory"``.
        message: For errors, the last lines of the traceback (or of the output) with the temp file path
            shown as ``example_<index>.py``; for timeouts ``"timed out after Ns"``; for memory
            ``"exceeded the memory limit of N MiB"``, followed by the traceback when there is one.
    """

    index: int
    line: int
    kind: ExampleFailureKind
    message: str


@dataclass(frozen=True)
class CodeCheckReport:
    """The outcome of running a lesson's examples.

    Attributes:
        examples: How many examples ran.
        failures: One entry per failing example, in example order.
    """

    examples: int
    failures: tuple[ExampleFailure, ...]

    @property
    def ok(self) -> bool:
        """Whether every example ran cleanly (vacuously true for a lesson without examples)."""
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        """Return the report as plain JSON-serialisable data."""
        return {"examples": self.examples, "ok": self.ok, "failures": [asdict(f) for f in self.failures]}


def extract_examples(markdown: str) -> list[Example]:
    """Return the runnable Python examples of a Markdown document.

    A block is runnable when it is fenced (with at least three backticks or tildes), the first word of its
    info string is ``python`` or ``py`` (any case) and the info string does not contain ``no-run``. Fences
    follow CommonMark: a block ends at a fence of the same character at least as long as the opening one
    (or at the end of the document), so a longer outer fence can show a ``python`` block as text without
    it being run. Unlike CommonMark, a fence may be indented by any amount (fences nested in list items are
    common in lessons), and that indentation is removed from the block's lines.

    Args:
        markdown: The lesson's Markdown source.

    Returns:
        The examples in document order, indexed from 0.
    """
    lines = _LINE_BREAK.split(markdown)
    if lines[-1] == "":
        lines.pop()  # what follows the final line break is not a line
    examples: list[Example] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        # A backtick fence's info string may not contain backticks (that line is inline code instead).
        if opening is None or (opening["fence"][0] == "`" and "`" in opening["info"]):
            i += 1
            continue
        fence, indent, info = opening["fence"], len(opening["indent"]), opening["info"].strip()
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            body.append(_strip_indent(lines[j], indent))
            j += 1
        words = info.split()
        if words and words[0].lower() in RUNNABLE_LANGUAGES and NO_RUN_MARKER not in info:
            code = "\n".join(body) + "\n" if body else ""
            examples.append(Example(index=len(examples), code=code, line=i + 1))
        i = j + 1
    return examples


async def run_examples(
    examples: Sequence[Example],
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 256,
    concurrency: int = 2,
) -> CodeCheckReport:
    """Run each example in its own sandboxed interpreter and collect the failures.

    Args:
        examples: What to run, usually from ``extract_examples``.
        timeout_s: Wall-clock limit per example; the CPU-time limit is set a little above it.
        memory_mb: Address-space limit per example (``RLIMIT_AS``, so it counts reserved virtual memory,
            not only what is touched).
        concurrency: How many examples run at the same time.

    Returns:
        The report, with failures in example order.

    Raises:
        ValueError: If a limit is not positive.
        SandboxUnavailable: The sandbox cannot run here and this is not dev mode (``LEDGERFLOW_ENV=dev``);
            the message is one line naming the missing tool.
    """
    if not timeout_s > 0 or memory_mb < 1 or concurrency < 1:
        raise ValueError("timeout_s, memory_mb and concurrency must be positive")
    sandboxed = await _sandboxed() if examples else True
    gate = asyncio.Semaphore(concurrency)

    async def run(example: Example) -> ExampleFailure | None:
        async with gate:
            failure = await _run_example(
                example, timeout_s=timeout_s, memory_mb=memory_mb, sandboxed=sandboxed
            )
        return failure if failure is None else replace(failure, message=scrub(failure.message))

    tasks = [asyncio.ensure_future(run(example)) for example in examples]
    try:
        outcomes = await asyncio.gather(*tasks)
    except BaseException:
        # Cancelled, or we could not start a child: stop (and so kill) the others before propagating.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return CodeCheckReport(
        examples=len(examples), failures=tuple(outcome for outcome in outcomes if outcome is not None)
    )


async def check_markdown(
    markdown: str, *, timeout_s: float = 10.0, memory_mb: int = 256, concurrency: int = 2
) -> CodeCheckReport:
    """Extract a lesson's Python examples and run them; see ``extract_examples`` and ``run_examples``.

    Args:
        markdown: The lesson's Markdown source.
        timeout_s: Wall-clock limit per example.
        memory_mb: Address-space limit per example.
        concurrency: How many examples run at the same time.

    Returns:
        The report.
    """
    return await run_examples(
        extract_examples(markdown), timeout_s=timeout_s, memory_mb=memory_mb, concurrency=concurrency
    )


async def _sandboxed() -> bool:
    """Whether examples run in the sandbox; without one, fall back loudly in dev mode and refuse otherwise."""
    found = await asyncio.to_thread(sandbox_status)
    if found.ok:
        return True
    # Imported here: this module stays importable by a bare interpreter (no pydantic), and only this rare
    # path needs the settings (read now, not cached).
    from runtime.settings import Settings

    if Settings().dev:
        log.warning(
            "code.validate: NO SANDBOX, running examples as the worker's own user (dev mode only): %s",
            found.reason,
        )
        return False
    raise SandboxUnavailable(f"code.validate refuses to run examples without a sandbox: {found.reason}")


# Environment variables whose values never leave codecheck in a failure text.
_SECRET_NAME = re.compile(r"KEY|SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL", re.IGNORECASE)
_URL_NAME = re.compile(r"DATABASE_URL|_DSN$|_URL$", re.IGNORECASE)
# Shorter values are too likely to be ordinary words or numbers ("1", "dev") to replace safely.
_SECRET_MIN = 4
REDACTED = "[redacted]"


def scrub(text: str, environ: Mapping[str, str] | None = None) -> str:
    """Replace every secret of ``environ`` (default: ours) that appears in ``text`` with ``[redacted]``.

    Secrets are the values of variables named like ``*KEY*``, ``*SECRET*``, ``*PASSWORD*``, ``*TOKEN*``
    (any case) and the password of any URL-valued variable (``LEDGERFLOW_DATABASE_URL``), raw and
    percent-decoded.
    """
    environ = os.environ if environ is None else environ
    secrets: set[str] = set()
    for name, value in environ.items():
        if _SECRET_NAME.search(name):
            secrets.add(value)
        if _URL_NAME.search(name) or "://" in value:
            with contextlib.suppress(ValueError):
                password = urlsplit(value).password
                if password:
                    secrets.update({password, unquote(password)})
    for secret in sorted((s for s in secrets if len(s) >= _SECRET_MIN), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text


@dataclass(frozen=True)
class _Run:
    returncode: int
    timed_out: bool
    stdout: bytes
    stderr: bytes


async def _run_example(
    example: Example, *, timeout_s: float, memory_mb: int, sandboxed: bool
) -> ExampleFailure | None:
    """Run one example (in the sandbox, or in a fresh temporary directory without one) and classify it."""
    name = f"example_{example.index}.py"
    if sandboxed:
        path = os.path.join(SANDBOX_TMP, name)  # the sandbox's private tmpfs
        run = await _run_child(
            example.code, path, SANDBOX_TMP, timeout_s=timeout_s, memory_mb=memory_mb, jail=True
        )
        return _classify(run, example, path, timeout_s=timeout_s, memory_mb=memory_mb)
    workdir = tempfile.TemporaryDirectory(prefix="codecheck-")
    try:
        path = os.path.join(workdir.name, name)
        run = await _run_child(
            example.code, path, workdir.name, timeout_s=timeout_s, memory_mb=memory_mb, jail=False
        )
    finally:
        # An example may leave many files or read-only directories behind; TemporaryDirectory.cleanup
        # resets permissions as it goes. Off the event loop, since it is disk I/O of unknown size.
        await asyncio.to_thread(workdir.cleanup)
    return _classify(run, example, path, timeout_s=timeout_s, memory_mb=memory_mb)


async def _run_child(
    code: str, path: str, workdir: str, *, timeout_s: float, memory_mb: int, jail: bool
) -> _Run:
    """Run the bootstrap on ``code`` (written to ``path``) under the limits; kill its process group after."""
    cpu_s = math.ceil(timeout_s) + 1
    argv = [
        sys.executable,
        "-I",
        "-c",
        _BOOTSTRAP,
        path,
        str(memory_mb * 1024 * 1024),
        str(cpu_s),
        str(NOFILE_LIMIT),
        str(FSIZE_LIMIT),
        workdir,
        str(MEMORY_EXIT),
        str(NPROC_LIMIT if jail else 0),
    ]
    env = _child_env(workdir)
    if jail:
        argv = sandbox_command(argv, env)
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=None if jail else workdir,
        env=env,
        # setsid in the child (async-signal-safe, unlike a preexec_fn under threads): its own process
        # group, so the timeout kills everything it started, not just the interpreter (in the sandbox, the
        # outer bwrap, whose death ends the sandbox's PID namespace and so everything in it).
        start_new_session=True,
    )
    out, err = _Tail(), _Tail()
    readers = asyncio.gather(
        _feed(process.stdin, code.encode()), out.drain(process.stdout), err.drain(process.stderr)
    )
    try:
        exited = await _wait_for_exit(process, timeout_s)
    except BaseException:
        # Cancelled: kill everything and release the pipes; nobody wants the output any more.
        _kill_group(process.pid)
        readers.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await readers
        # SIGKILL cannot be caught, so this is quick; closing the transport first would make asyncio kill
        # (and log about) a child it has not yet seen exit.
        await _wait_for_exit(process, PIPE_GRACE_S)
        _close_transport(process)
        await process.wait()
        raise
    # Also after a normal exit: background children left in the group would otherwise keep running (and
    # keep our pipes open). The kernel does not reuse a group id while any member lives; once the group is
    # empty the call just fails with ESRCH.
    _kill_group(process.pid)
    try:
        await asyncio.wait_for(readers, PIPE_GRACE_S)
    except TimeoutError:
        # A descendant left the group (setsid) and holds the pipes: keep what was read and stop listening.
        _close_transport(process)
    returncode = await process.wait()
    if jail and returncode > 128 and _is_signal(returncode - 128):
        # bwrap reports a child killed by signal N as exit status 128 + N.
        returncode = -(returncode - 128)
    return _Run(returncode=returncode, timed_out=not exited, stdout=bytes(out.kept), stderr=bytes(err.kept))


async def _feed(stream: asyncio.StreamWriter | None, data: bytes) -> None:
    """Write the example's source to the bootstrap's stdin and close it (it may die before reading it all)."""
    if stream is None:
        return
    with contextlib.suppress(ConnectionError):
        stream.write(data)
        await stream.drain()
    with contextlib.suppress(ConnectionError):
        stream.close()


async def _wait_for_exit(process: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """Wait until the child itself exits; return whether it did within ``timeout_s``.

    ``Process.wait()`` would be the obvious tool, but (on 3.11) it also waits for the stdout/stderr pipes
    to close, so an example that leaves a background child holding them would count as timed out.
    ``returncode`` is set as soon as the child is reaped, so poll it, backing off from 5 to 50 ms.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay = 0.005
    while process.returncode is None:
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        await asyncio.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.05)
    return True


def _close_transport(process: asyncio.subprocess.Process) -> None:
    """Close the child's pipes without waiting for EOF.

    asyncio offers no public way to do this; without it the transport stays open, and warns when collected,
    for as long as some escaped descendant keeps a pipe open.
    """
    transport = getattr(process, "_transport", None)
    if transport is not None:
        transport.close()


def _child_env(workdir: str) -> dict[str, str]:
    """Build the example's environment from scratch: nothing of ours (keys, URLs) is passed on."""
    return {
        "PATH": CHILD_PATH,
        "LANG": "C.UTF-8",
        # Libraries that cache or configure under ~ or in the temp dir write inside the sandbox.
        "HOME": workdir,
        "TMPDIR": workdir,
        # RLIMIT_AS counts reserved address space, and glibc reserves 64 MiB per thread arena: without this
        # a modest thread pool fails with "can't start new thread" under a 256 MiB limit.
        "MALLOC_ARENA_MAX": "2",
    }


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class _Tail:
    """The last ``OUTPUT_LIMIT`` bytes of a stream, kept where they survive a cancelled read."""

    def __init__(self) -> None:
        self.kept = bytearray()

    async def drain(self, stream: asyncio.StreamReader | None) -> None:
        """Read ``stream`` to EOF, dropping all but the tail (tracebacks come last)."""
        if stream is None:
            return
        while chunk := await stream.read(OUTPUT_LIMIT):
            self.kept += chunk
            if len(self.kept) > OUTPUT_LIMIT:
                del self.kept[:-OUTPUT_LIMIT]


def _classify(
    run: _Run, example: Example, path: str, *, timeout_s: float, memory_mb: int
) -> ExampleFailure | None:
    """Turn how the child ended into a failure, or ``None`` if it exited cleanly."""
    code = run.returncode
    if code == 0 and not run.timed_out:
        return None
    output = _tidy(run.stderr or run.stdout, example, path)
    kind: ExampleFailureKind
    if run.timed_out:
        kind, message = "timeout", f"timed out after {timeout_s:g}s"
    elif code == -signal.SIGXCPU:
        # Busy threads can use CPU time faster than the wall clock runs.
        kind, message = "timeout", f"timed out after {math.ceil(timeout_s) + 1}s of CPU time"
    elif code == MEMORY_EXIT or code == -signal.SIGKILL or (code < 0 and _mentions_memory(output)):
        # MemoryError (reported by the bootstrap), the kernel's OOM killer (we only send SIGKILL ourselves
        # on timeout), or a C-level crash on a failed allocation.
        kind, message = "memory", f"exceeded the memory limit of {memory_mb} MiB"
        if output:
            message = f"{message}\n{output}"
    elif code > 0 and _hit_process_limit(output):
        kind, message = "error", f"exceeded the process limit of {NPROC_LIMIT} processes\n{output}"
    elif code > 0:
        kind, message = "error", output or f"exited with status {code}"
    else:
        kind, message = "error", "\n".join(filter(None, [f"killed by signal {_signal_name(-code)}", output]))
    return ExampleFailure(index=example.index, line=example.line, kind=kind, message=_trim(message))


def _tidy(raw: bytes, example: Example, path: str) -> str:
    """Decode output, name the example file as the lesson does and keep the traceback's last lines."""
    text = raw.decode("utf-8", errors="replace")
    name = f"example_{example.index}.py"
    sandbox = os.path.dirname(path)
    # The temp dir may be reached through a symlink (/tmp on some systems), so replace both spellings.
    for directory in dict.fromkeys([sandbox, os.path.realpath(sandbox)]):
        text = text.replace(os.path.join(directory, name), name).replace(directory, ".")
    return "\n".join(text.rstrip().splitlines()[-TRACEBACK_LINES:])


def _trim(message: str) -> str:
    # The end of a traceback (the exception and the failing line) matters most, so keep the tail.
    return message if len(message) <= MESSAGE_CHARS else "…" + message[-(MESSAGE_CHARS - 1) :]


def _mentions_memory(output: str) -> bool:
    lowered = output.lower()
    return any(word in lowered for word in ("memoryerror", "cannot allocate memory", "out of memory"))


def _hit_process_limit(output: str) -> bool:
    # fork/clone/thread start failing with EAGAIN is what RLIMIT_NPROC looks like from Python. Any line,
    # not only the last: a fork bomb's children write their tracebacks to one stderr at once, interleaved,
    # so the output often ends on another child's "Traceback (most recent call last):" (seen in CI).
    return any(
        line.startswith(("BlockingIOError: [Errno 11]", "RuntimeError: can't start new thread"))
        or line.endswith("Resource temporarily unavailable")
        for line in (raw.strip() for raw in output.splitlines())
    )


def _is_signal(number: int) -> bool:
    try:
        signal.Signals(number)
    except ValueError:
        return False
    return True


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _strip_indent(line: str, width: int) -> str:
    """Remove up to ``width`` leading spaces or tabs (the opening fence's indentation)."""
    stripped = 0
    while stripped < width and stripped < len(line) and line[stripped] in " \t":
        stripped += 1
    return line[stripped:]
