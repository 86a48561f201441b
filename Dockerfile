# One image for the worker, the CLI and the vendor simulator.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
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
COPY examples examples
COPY worker.py ./
RUN pip install --no-cache-dir .
# Workers hold no state: scale them with `docker compose up --scale worker=N`.
CMD ["python", "worker.py"]
