"""Issue 24 §7: stack.json holds the review tokens, so only its owner may read it (0600), and it is
replaced atomically (never a moment when it exists with a wider mode, or half written)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from ledgerflow.stack.services import write_stack


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_stack_json_is_written_owner_only_even_under_a_loose_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_stack(tmp_path, {"review_tokens": {"alice": "secret"}})
    finally:
        os.umask(old)
    assert path == tmp_path / "stack.json"
    assert mode(path) == 0o600
    assert json.loads(path.read_text())["review_tokens"] == {"alice": "secret"}
    assert [p.name for p in tmp_path.iterdir()] == ["stack.json"]  # no temporary file left behind


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_an_old_world_readable_stack_json_is_replaced_by_an_owner_only_one(tmp_path):
    old = tmp_path / "stack.json"
    old.write_text("{}")
    old.chmod(0o644)
    inode = os.stat(old).st_ino
    write_stack(tmp_path, {"pids": {"worker": 1}})
    assert mode(old) == 0o600
    assert os.stat(old).st_ino != inode  # a new file renamed over the old one, not rewritten in place
    assert json.loads(old.read_text()) == {"pids": {"worker": 1}}
