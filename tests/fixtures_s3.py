"""A real S3-compatible server on 127.0.0.1 for the object-storage tests: moto's server mode.

``s3_server`` starts one moto server for the session (port chosen by the OS); ``s3`` gives a
test a fresh bucket and points the standard AWS variables at the server, so pyarrow, boto3 and
every process the test starts (an embedded Ray's workers inherit the environment) reach that
server and nothing else: ``AWS_EC2_METADATA_DISABLED`` keeps the AWS SDKs from probing the
instance-metadata address for credentials.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "dpfl-test",
    "AWS_SECRET_ACCESS_KEY": "dpfl-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
_buckets = itertools.count()


@dataclass(frozen=True)
class S3Bucket:
    endpoint: str  # http://127.0.0.1:PORT
    bucket: str
    env: dict[str, str]  # the variables a subprocess needs to reach it

    def uri(self, *keys: str) -> str:
        """``s3://bucket/key/...``."""
        return "/".join([f"s3://{self.bucket}", *keys])

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint)

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key in the bucket under ``prefix``, sorted."""
        pages = self.client().get_paginator("list_objects_v2")
        found = pages.paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(item["Key"] for page in found for item in page.get("Contents", []))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 for the session; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch) -> S3Bucket:
    """A new, empty bucket on the session's server, with the AWS variables set for this test."""
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_server}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    bucket = S3Bucket(s3_server, f"dpfl-test-{next(_buckets)}", env)
    bucket.client().create_bucket(Bucket=bucket.bucket)
    return bucket
