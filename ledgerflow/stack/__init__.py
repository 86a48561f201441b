"""The embedded dev stack: ``pg`` (PostgreSQL from PyPI), ``services`` (Temporal, the workers, the reviewer
page; ``up``/``down``) and ``demo`` (``ledgerflow demo``)."""
