"""A real S3 API for checkpoint tests: moto's server mode on 127.0.0.1 (port 0).

Import the fixtures into a test module (``from integration.s3_fixture import moto_s3,
s3_root``; tests/conftest.py puts tests/ on sys.path).
The server runs in a thread of the test process for the whole session; each test gets
its own bucket. s3fs needs ``AWS_DEFAULT_REGION`` (not ``region_name``) or bucket
creation fails against moto, and fake credentials so botocore does not look for real ones.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator

import pytest

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 for the session; yields its endpoint URL."""
    pytest.importorskip("s3fs", reason="s3fs (the 's3' extra) is needed for s3:// tests")
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(S3_ENV)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_root(moto_s3: str) -> Iterator[tuple[str, dict[str, str]]]:
    """A fresh bucket: yields (``s3://<bucket>/ckpt``, storage options for fsspec)."""
    import s3fs

    options = {"endpoint_url": moto_s3}
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir(bucket)
    yield f"s3://{bucket}/ckpt", options
    fs.rm(bucket, recursive=True)
