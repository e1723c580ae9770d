"""A throwaway S3 endpoint on loopback (moto's server) for the object-store adapter tests.

X
other S3-compatible store: ``FSSPEC_S3_ENDPOINT_URL`` and AWS test credentials. Child processes
(engine cores) inherit them.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextmanager
def s3_server(monkeypatch) -> Iterator[str]:
    """An S3 endpoint with an empty bucket ``loraplex``; yields ``s3://loraplex``.

    Args:
        monkeypatch: A pytest ``MonkeyPatch`` that sets (and later unsets) the environment.
    """
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        for name, value in {**ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items():
            monkeypatch.setenv(name, value)
        import urllib.request

        import s3fs

        # moto keeps its buckets in this process: start from none, whatever ran before.
        reset = urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/reset", method="POST")
        urllib.request.urlopen(reset, timeout=10).close()
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir("loraplex")
        yield "s3://loraplex"
    finally:
        server.stop()
