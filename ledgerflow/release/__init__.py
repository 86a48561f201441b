"""Releases anyone can verify (issue 27 §5; docs/releases.md).

``ledgerflow release TASK`` (:mod:`ledgerflow.release.build`) rebuilds a finished task's final output from the
ledger and the content store, refuses unless it hashes to what the ledger recorded, and writes a provenance
manifest signed with a registered release key. ``ledgerflow verify`` (:mod:`ledgerflow.release.manifest`)
checks a manifest, and the file it describes, with nothing but the manifest, the file and a public key: no
database, no network.

This package's ``__init__`` imports nothing: ``verify`` must load without the ledger's modules.
"""
