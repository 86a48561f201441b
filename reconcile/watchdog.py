"""The stall watchdog: a job whose progress stops for longer than its threshold is stalled."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StallWatch:
    """Feed it each poll's progress and a monotonic time; it says when progress stopped too long ago.

    A vendor that reports no progress (``None``) shows none: such a job is stalled once it has run for the
    threshold without ever reporting any, which is the same promise for every vendor.
    """

    threshold: float
    _last: float | None = field(default=None, init=False)
    _since: float | None = field(default=None, init=False)

    def stalled(self, progress: float | None, now: float) -> bool:
        if self._since is None or (progress is not None and (self._last is None or progress > self._last)):
            self._last, self._since = progress, now
            return False
        return now - self._since > self.threshold
