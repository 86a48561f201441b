"""Operator views: what the CLI (and the reviewer page) read from the ledger and Temporal and show."""
