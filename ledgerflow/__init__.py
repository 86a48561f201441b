"""ledgerflow: trustworthy orchestration for long, paid, multi-agent generation pipelines."""
