"""Process helpers the lower layers need (the artifact store's stale-temp sweep, the embedded stack)."""

from __future__ import annotations

import os
from pathlib import Path


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped, counts as dead)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        # No procfs (macOS): fall back to signal 0, which cannot tell a zombie from a live process.
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    # The command name in parentheses may contain spaces or parentheses: the state follows the last ")".
    return status.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
