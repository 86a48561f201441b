"""Run the Python code examples of a Markdown lesson in isolated subprocesses and report which fail, and why.

A generated programming lesson is only worth paying for if its examples really run. ``check_markdown``
extracts every fenced ``python`` / ``py`` block and runs each one in its own interpreter:

* ``sys.executable -I`` (isolated mode: no ``PYTHON*`` variables, no user site-packages) in a fresh
  temporary working directory that is deleted afterwards; the example runs as ``__main__`` from
  ``example_<index>.py`` in that directory, as ``python example_<index>.py`` would run it;
* an environment built from scratch (``PATH``, ``LANG``, plus ``HOME``/``TMPDIR`` pointing into the sandbox
  directory): nothing of the parent's environment, so no API keys or database URLs, reaches the example;
* stdin on ``/dev/null``; stdout and stderr captured, keeping at most 64 KiB of each (the tail, where the
  traceback is) while draining the rest so a chatty example can neither block nor balloon our memory;
* resource limits applied by a small bootstrap before the example's first line runs: ``RLIMIT_AS`` (memory;
  it counts the interpreter's own ~15 MiB of address space and reserved-but-untouched mappings, so it is a
  ceiling on address space rather than on resident memory), ``RLIMIT_CPU`` (slightly above the wall-clock
  timeout), ``RLIMIT_NOFILE``, ``RLIMIT_FSIZE`` and no core dumps. Soft and hard limits are set equal, so
  the example cannot raise them back (and, in case we run as root, the ``resource.setrlimit`` /
  ``resource.prlimit`` audit events are refused as well);
* its own session and process group, which the wall-clock timeout kills as a whole (and which is killed
  after a normal exit too, so a stray background child does not outlive its example; one that starts its own
  session escapes, and we then stop reading its output after a grace period rather than wait for it);
* no network, best effort: the bootstrap installs a ``sys.addaudithook`` hook that refuses
  ``socket.__new__`` for anything but ``AF_UNIX``, ``socket.connect`` / ``socket.bind`` to anything but a
  Unix socket path inside the sandbox directory, and every name lookup (``socket.getaddrinfo``,
  ``gethostbyname``, ``gethostbyaddr``, ``getnameinfo``). The hook is installed before user code runs and
  cannot be removed by it (CPython offers no way to remove an audit hook). It is an in-process guard, not a
  kernel sandbox: ``ctypes`` calling libc directly, a C extension opening sockets without the audit calls, or
  a program started with ``subprocess`` (``curl``, another interpreter) are not covered. ``AF_UNIX`` sockets
  stay allowed because ``asyncio`` needs a ``socketpair`` for its event loop and ``multiprocessing``
  managers listen on a socket file in the temp directory.

An example fails when its interpreter exits non-zero, and also when one of its threads died of an uncaught
exception (Python prints that and still exits 0, but the lesson's reader would see a traceback).

The process is not a security boundary against hostile code (no namespaces, no seccomp, same user); it keeps
honest-but-buggy examples from hanging the pipeline, eating the worker's memory, reading its secrets or
talking to the internet.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import signal
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = [
    "CodeCheckReport",
    "Example",
    "ExampleFailure",
    "ExampleFailureKind",
    "check_markdown",
    "extract_examples",
    "run_examples",
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
# argv = [path, memory_bytes, cpu_s, nofile, fsize, sandbox, memory_exit].
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
    memory, cpu, nofile, fsize, memory_exit = map(int, argv[2:6] + argv[7:8])

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
    """
    if not timeout_s > 0 or memory_mb < 1 or concurrency < 1:
        raise ValueError("timeout_s, memory_mb and concurrency must be positive")
    gate = asyncio.Semaphore(concurrency)

    async def run(example: Example) -> ExampleFailure | None:
        async with gate:
            return await _run_example(example, timeout_s=timeout_s, memory_mb=memory_mb)

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


@dataclass(frozen=True)
class _Run:
    returncode: int
    timed_out: bool
    stdout: bytes
    stderr: bytes


async def _run_example(example: Example, *, timeout_s: float, memory_mb: int) -> ExampleFailure | None:
    """Run one example in a fresh temporary directory and classify how it ended."""
    sandbox = tempfile.TemporaryDirectory(prefix="codecheck-")
    try:
        path = os.path.join(sandbox.name, f"example_{example.index}.py")
        with open(path, "w", encoding="utf-8") as file:
            file.write(example.code)
        run = await _run_sandboxed(path, sandbox.name, timeout_s=timeout_s, memory_mb=memory_mb)
    finally:
        # An example may leave many files or read-only directories behind; TemporaryDirectory.cleanup
        # resets permissions as it goes. Off the event loop, since it is disk I/O of unknown size.
        await asyncio.to_thread(sandbox.cleanup)
    return _classify(run, example, path, timeout_s=timeout_s, memory_mb=memory_mb)


async def _run_sandboxed(path: str, sandbox: str, *, timeout_s: float, memory_mb: int) -> _Run:
    """Run the bootstrap on ``path`` under the limits, killing its process group when done."""
    cpu_s = math.ceil(timeout_s) + 1
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-c",
        _BOOTSTRAP,
        path,
        str(memory_mb * 1024 * 1024),
        str(cpu_s),
        str(NOFILE_LIMIT),
        str(FSIZE_LIMIT),
        sandbox,
        str(MEMORY_EXIT),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=sandbox,
        env=_child_env(sandbox),
        # setsid in the child (async-signal-safe, unlike a preexec_fn under threads): its own process
        # group, so the timeout kills everything it started, not just the interpreter.
        start_new_session=True,
    )
    out, err = _Tail(), _Tail()
    readers = asyncio.gather(out.drain(process.stdout), err.drain(process.stderr))
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
    return _Run(returncode=returncode, timed_out=not exited, stdout=bytes(out.kept), stderr=bytes(err.kept))


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


def _child_env(sandbox: str) -> dict[str, str]:
    """Build the example's environment from scratch: nothing of ours (keys, URLs) is passed on."""
    return {
        "PATH": CHILD_PATH,
        "LANG": "C.UTF-8",
        # Libraries that cache or configure under ~ or in the temp dir write inside the sandbox.
        "HOME": sandbox,
        "TMPDIR": sandbox,
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
