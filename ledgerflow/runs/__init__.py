"""Drills and runs: the crash drill, the outage drill, the soak and route qualification."""
