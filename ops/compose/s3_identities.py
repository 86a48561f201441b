"""The S3 store's identities inside docker-compose.yml: an admin, and the workers' bucket-scoped identity.

SeaweedFS's S3 gateway reads its identities from a static JSON file (``weed server -s3.config FILE``). The
one-shot ``s3-identities`` job writes that file, before the store starts, from the environment only:

    python s3_identities.py --out /var/lib/ledgerflow/s3-iam/identities.json --bucket ledgerflow

* ``admin`` (``S3_ADMIN_ACCESS_KEY_ID`` / ``S3_ADMIN_SECRET_ACCESS_KEY``): every action; for an operator's
  maintenance, given to no ledgerflow process.
* ``ledgerflow-worker`` (``S3_WORKER_ACCESS_KEY_ID`` / ``S3_WORKER_SECRET_ACCESS_KEY``): ``Read``, ``Write``
  and ``List`` on the artifacts bucket only — no ``Admin``, no other bucket, no bucket creation or deletion,
  no ACLs or tagging. (SeaweedFS's ``Write`` also covers deleting an object in that bucket: its identity model
  has no separate delete action.)

Every variable is required and non-empty, and the two access keys must differ (the store refuses duplicates):
otherwise one line on stderr and exit 2, and nothing is written. The file is written 0600 and replaced
atomically on every run, so changing a key in the environment and running ``docker compose up -d`` then
``docker compose restart seaweedfs`` (the store reads the file at start) rotates it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

VARIABLES = (
    "S3_ADMIN_ACCESS_KEY_ID",
    "S3_ADMIN_SECRET_ACCESS_KEY",
    "S3_WORKER_ACCESS_KEY_ID",
    "S3_WORKER_SECRET_ACCESS_KEY",
)
WORKER_ACTIONS = ("Read", "Write", "List")
BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


class Refused(Exception):
    """The environment cannot make a usable identities file (one line)."""


def identities(env: Mapping[str, str], bucket: str) -> dict[str, Any]:
    """SeaweedFS's ``-s3.config`` document for ``bucket``. Refused if a variable is missing or empty, the
    keys collide or the bucket name is not one."""
    missing = [name for name in VARIABLES if not env.get(name)]
    if missing:
        raise Refused(f"set {', '.join(missing)} (no defaults: the S3 store's identities come from them)")
    if env["S3_ADMIN_ACCESS_KEY_ID"] == env["S3_WORKER_ACCESS_KEY_ID"]:
        raise Refused("S3_WORKER_ACCESS_KEY_ID must differ from S3_ADMIN_ACCESS_KEY_ID")
    if not BUCKET.fullmatch(bucket):
        raise Refused(f"{bucket!r} is not a bucket name")

    def credentials(who: str) -> list[dict[str, str]]:
        return [
            {"accessKey": env[f"S3_{who}_ACCESS_KEY_ID"], "secretKey": env[f"S3_{who}_SECRET_ACCESS_KEY"]}
        ]

    return {
        "identities": [
            {
                "name": "admin",
                "credentials": credentials("ADMIN"),
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            },
            {
                "name": "ledgerflow-worker",
                "credentials": credentials("WORKER"),
                "actions": [f"{action}:{bucket}" for action in WORKER_ACTIONS],
            },
        ]
    }


def write(path: Path, document: Mapping[str, Any]) -> None:
    """``path`` replaced atomically by ``document``, mode 0600 (it holds secret keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(document, f, indent=2)
    tmp.chmod(0o600)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bucket", required=True)
    args = parser.parse_args(argv)
    try:
        document = identities(os.environ, args.bucket)
    except Refused as e:
        print(f"s3-identities: {e}", file=sys.stderr)
        return 2
    write(args.out, document)
    names = ", ".join(i["name"] for i in document["identities"])
    print(f"wrote {args.out}: {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
