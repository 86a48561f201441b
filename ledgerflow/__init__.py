"""ledgerflow: trustworthy orchestration for long, paid, multi-agent generation pipelines."""

from __future__ import annotations


def installed_version() -> str | None:
    """This ledgerflow's version as installed, or None (run from a checkout that was never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ledgerflow")
    except PackageNotFoundError:
        return None
