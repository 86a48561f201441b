"""The artifact store tests use the session's S3 endpoint (``s3_endpoint``, from ``tests/s3kit.py``)."""
