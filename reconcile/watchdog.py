"""The stall watchdog: a job whose progress stops for longer than its threshold is stalled."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StallWatch:
    """Feed it each poll's progress and a monotonic time; it says when progress stopped too long ago."""

    threshold: float
    _last: float | None = field(default=None, init=False)
    _since: float = field(default=0.0, init=False)

    def stalled(self, progress: float, now: float) -> bool:
        if self._last is None or progress > self._last:
            self._last, self._since = progress, now
            return False
        return now - self._since > self.threshold
