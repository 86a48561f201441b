"""vendors.codecheck: which lesson blocks are examples; how sandboxed runs pass, fail and are contained.

Every run is a real child interpreter under the real limits; the limits are kept small so the whole module
takes a few seconds.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from vendors.codecheck import (
    CodeCheckReport,
    Example,
    ExampleFailure,
    check_markdown,
    extract_examples,
    run_examples,
)


def lesson(*blocks: str) -> str:
    """A Markdown lesson with one ```python block per argument, separated by prose."""
    parts = ["# Lesson", ""]
    for n, code in enumerate(blocks):
        parts += [f"Step {n}:", "", "```python", textwrap.dedent(code).strip("\n"), "```", ""]
    return "\n".join(parts)


def fence_line(markdown: str, occurrence: int) -> int:
    """The 1-based line of the ``occurrence``-th ```python fence."""
    lines = [n for n, line in enumerate(markdown.split("\n"), 1) if line == "```python"]
    return lines[occurrence]


# --- extraction ---------------------------------------------------------------------------------------------

EXTRACTION_LESSON = """\
# Title

```python
a = 1
```

```py
b = 2
```

~~~python
c = 3
~~~

```text
not python
```

````markdown
```python
shown = "as text, never run"
```
````

~~~~
```python
also_text = True
```
~~~~

```python no-run
input("never")
```

1. In a list:

   ```Python title="x.py"
   d = 4
     indented = True
   ```

```pycon
>>> 1
```

```` py
e = 5
```
still = "inside, the closing fence was too short"
````

```python
unterminated = True
"""


def test_extracts_python_and_py_blocks_with_their_fence_lines() -> None:
    examples = extract_examples(EXTRACTION_LESSON)

    assert examples == [
        Example(index=0, code="a = 1\n", line=3),
        Example(index=1, code="b = 2\n", line=7),
        Example(index=2, code="c = 3\n", line=11),
        Example(index=3, code="d = 4\n  indented = True\n", line=37),
        Example(
            index=4,
            code='e = 5\n```\nstill = "inside, the closing fence was too short"\n',
            line=46,
        ),
        # An unclosed fence runs to the end of the document, as in CommonMark.
        Example(index=5, code="unterminated = True\n", line=52),
    ]


def test_extraction_handles_crlf_and_backtick_info_strings() -> None:
    markdown = "intro\r\n```python\r\nx = 1\r\n```\r\n``` py `inline` ```\r\n```py\r\ny = 2\r\n```\r\n"

    assert extract_examples(markdown) == [
        Example(index=0, code="x = 1\n", line=2),
        # Line 5 has a backtick in its info string, so it is inline code, not a fence.
        Example(index=1, code="y = 2\n", line=6),
    ]
    assert extract_examples("no code here") == []


# --- running ------------------------------------------------------------------------------------------------


async def test_a_passing_lesson_is_ok() -> None:
    markdown = lesson(
        """
        def greet(name):
            return f"hello {name}"

        if __name__ == "__main__":
            assert greet("world") == "hello world"
        """,
        # asyncio needs an AF_UNIX socketpair: the network guard must let it through.
        """
        import asyncio

        async def main():
            await asyncio.sleep(0)
            return 42

        assert asyncio.run(main()) == 42
        """,
        # Threads reserve address space; the memory limit must still leave room for a small pool.
        """
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            assert sum(pool.map(lambda n: len(bytes(n * 100_000)), range(32))) == 49_600_000
        """,
        # Unix sockets inside the sandbox are local IPC, not network.
        """
        import socket

        server = socket.socket(socket.AF_UNIX)
        server.bind("ipc.sock")
        server.listen()
        try:
            socket.socket(socket.AF_UNIX).connect("/run/elsewhere.sock")
        except PermissionError:
            pass
        else:
            raise AssertionError("a Unix socket outside the sandbox was reachable")
        """,
        "import sys; sys.exit(0)",
    )

    report = await check_markdown(markdown, timeout_s=5)

    assert report == CodeCheckReport(examples=5, failures=())
    assert report.ok
    assert report.to_json() == {"examples": 5, "ok": True, "failures": []}


async def test_an_error_reports_the_real_traceback_under_the_example_name() -> None:
    markdown = lesson(
        "print('fine')",
        """
        def ratio(a, b):
            return a / b
        print(ratio(1, 0))
        """,
    )

    report = await check_markdown(markdown, timeout_s=5)

    assert not report.ok
    assert report.examples == 2
    [failure] = report.failures
    assert (failure.index, failure.line, failure.kind) == (1, fence_line(markdown, 1), "error")
    message = failure.message
    assert message.startswith("Traceback (most recent call last):")
    assert message.endswith("ZeroDivisionError: division by zero")
    assert 'File "example_1.py", line 2, in ratio\n    return a / b' in message
    assert 'File "example_1.py", line 3, in <module>' in message
    # Only the example's frames: not the bootstrap that ran it, not the temp directory it ran in.
    assert "<string>" not in message
    assert tempfile.gettempdir() not in message
    assert "codecheck-" not in message
    assert json.loads(json.dumps(report.to_json())) == {
        "examples": 2,
        "ok": False,
        "failures": [{"index": 1, "line": failure.line, "kind": "error", "message": message}],
    }


async def test_syntax_errors_exit_statuses_and_crashed_threads_are_errors() -> None:
    markdown = lesson(
        "x = = 1",
        "import sys; sys.exit(3)",
        "raise SystemExit('bye')",
        # Python itself exits 0 here, but the lesson's reader would see a traceback.
        """
        import threading
        threading.Thread(target=lambda: {}["missing"]).start()
        print("main thread done")
        """,
    )

    report = await check_markdown(markdown)

    assert [(f.index, f.kind) for f in report.failures] == [(n, "error") for n in range(4)]
    syntax, status, text, thread = (f.message for f in report.failures)
    assert 'File "example_0.py", line 1' in syntax
    assert syntax.endswith("SyntaxError: invalid syntax")
    assert status == "exited with status 3"
    assert text == "bye"
    assert thread.startswith("Exception in thread")
    assert 'File "example_3.py", line 2, in <lambda>' in thread
    assert thread.endswith("KeyError: 'missing'")


async def test_an_infinite_loop_times_out_and_everything_it_started_is_killed() -> None:
    marker = _marker()
    # The example starts a grandchild (one that even leaves the process group), then spins.
    markdown = lesson(
        f"""
        import subprocess
        subprocess.Popen(["sleep", "{marker}"], start_new_session=True)
        while True:
            pass
        """
    )

    started = time.monotonic()
    report = await check_markdown(markdown, timeout_s=1)
    elapsed = time.monotonic() - started

    assert elapsed < 3
    assert report.failures == (
        ExampleFailure(index=0, line=fence_line(markdown, 0), kind="timeout", message="timed out after 1s"),
    )
    assert _running(marker) == []


async def test_allocating_past_the_limit_is_a_memory_failure() -> None:
    report = await check_markdown(lesson("print('ok')", "data = bytearray(2 * 1024**3)"), memory_mb=256)

    [failure] = report.failures
    assert (failure.index, failure.kind) == (1, "memory")
    assert failure.message.startswith("exceeded the memory limit of 256 MiB")
    assert failure.message.endswith("MemoryError")
    assert 'File "example_1.py", line 1' in failure.message


async def test_the_network_is_blocked() -> None:
    markdown = lesson(
        """
        import socket
        socket.create_connection(("127.0.0.1", 9), timeout=1)
        """,
        """
        import urllib.request
        urllib.request.urlopen("http://example.com", timeout=1)
        """,
        """
        import socket
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        """,
    )

    report = await check_markdown(markdown, timeout_s=5)

    assert [(f.index, f.kind) for f in report.failures] == [(0, "error"), (1, "error"), (2, "error")]
    for failure in report.failures:
        assert "network access is blocked" in failure.message.splitlines()[-1]
    assert report.failures[1].message.endswith("(getaddrinfo 'example.com'); mark the block python no-run>")


async def test_the_example_does_not_inherit_our_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEDGERFLOW_CODECHECK_SECRET", "sk-live-do-not-leak")
    markdown = lesson(
        """
        import os, sys
        sys.exit(f"secret={os.environ.get('LEDGERFLOW_CODECHECK_SECRET', '')} keys={sorted(os.environ)}")
        """
    )

    [failure] = (await check_markdown(markdown)).failures

    # PWD is bwrap's (the sandbox's working directory).
    assert failure.message == "secret= keys=['HOME', 'LANG', 'MALLOC_ARENA_MAX', 'PATH', 'PWD', 'TMPDIR']"


async def test_examples_run_concurrently_each_in_its_own_directory() -> None:
    markdown = lesson(
        """
        import os, time
        open("mine.txt", "w").write("example 0 was here")
        time.sleep(1)
        assert sorted(os.listdir(".")) == ["example_0.py", "mine.txt"]
        """,
        """
        import os, time
        time.sleep(0.5)  # example 0 has written its file by now
        assert not os.path.exists("mine.txt")
        assert os.listdir(".") == ["example_1.py"]
        time.sleep(0.5)
        """,
    )

    started = time.monotonic()
    report = await check_markdown(markdown, timeout_s=5, concurrency=2)
    elapsed = time.monotonic() - started

    assert report.ok, report.failures
    # Two one-second examples back to back would take over two seconds.
    assert elapsed < 1.8


async def test_output_floods_and_background_children_do_not_hang_a_run() -> None:
    markdown = lesson(
        """
        import subprocess, sys
        subprocess.Popen(["sleep", "60"])  # holds our stdout open; killed with the group
        sys.stdout.write("x" * 5_000_000)
        sys.stderr.write("y" * 5_000_000)
        """
    )

    started = time.monotonic()
    report = await check_markdown(markdown, timeout_s=5)

    assert report.ok, report.failures
    assert time.monotonic() - started < 2


async def test_cancelling_a_run_kills_its_examples() -> None:
    marker = _marker()
    markdown = lesson(
        f"""
        import subprocess
        subprocess.Popen(["sleep", "{marker}"])
        while True:
            pass
        """
    )
    run = asyncio.create_task(check_markdown(markdown, timeout_s=30))
    deadline = time.monotonic() + 5
    while not _running(marker):
        assert time.monotonic() < deadline, "the example never started"
        await asyncio.sleep(0.02)

    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run

    deadline = time.monotonic() + 2
    while _running(marker) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)  # SIGKILL is asynchronous: the PID namespace empties a moment later
    assert _running(marker) == []


async def test_limits_must_be_positive() -> None:
    for limits in ({"timeout_s": 0}, {"memory_mb": 0}, {"concurrency": 0}):
        with pytest.raises(ValueError):
            await run_examples([Example(index=0, code="", line=1)], **limits)


def _marker() -> str:
    """A ``sleep`` argument no other process uses, so the host's /proc finds the example's children."""
    return f"{3000 + secrets.randbelow(10**6) / 10**6:.6f}"


def _running(marker: str) -> list[int]:
    """Host pids of live (not zombie) ``sleep <marker>`` processes, whatever namespace they run in."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if argv[:2] == [b"sleep", marker.encode()] and state != "Z":
            found.append(int(entry.name))
    return found


async def test_a_process_limit_is_named_when_other_tracebacks_come_after_it() -> None:
    """A fork bomb's children share one stderr: the EAGAIN line often precedes another's header."""
    markdown = lesson(
        """
        import sys
        sys.stderr.write("Traceback (most recent call last):\\n")
        sys.stderr.write("BlockingIOError: [Errno 11] Resource temporarily unavailable\\n")
        sys.stderr.write("Traceback (most recent call last):\\n")
        sys.exit(1)
        """
    )

    [failure] = (await check_markdown(markdown)).failures

    assert failure.kind == "error"
    assert failure.message.startswith("exceeded the process limit of 64 processes\n")
