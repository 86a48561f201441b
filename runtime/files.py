"""Files only their owner may read (keys, the stack's tokens), written atomically: never half written, never
for a moment with a wider mode."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by its owner only: a new file (0600 whatever the umask) in the
    same directory, renamed over the old one; nothing is left behind if it fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
