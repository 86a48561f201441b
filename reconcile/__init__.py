"""Reconciliation: what ends an INTENT that has no OUTCOME (design.md §7).

Planned here (the crash-safety issue): look an open INTENT's job up at the vendor by its OperationKey →
resume or record the outcome; provably absent → SystemMarker(void) then resubmit; the vendor cannot tell →
Failure(unknown_outcome) and a cost-anomaly marker. Also the stall watchdog and the takeover scan.

Already in place and relied on by those mechanisms: every external call's key is ``task:node:aN`` (stable
across retries, restarts and resets), executors check the task's epoch before any vendor call, and the
result key ``{operation_key}:result`` admits exactly one Outcome or Failure per operation.
"""
