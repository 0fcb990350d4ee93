"""A real S3-protocol server on loopback for the remote-tier tests: moto's server mode, started
and stopped by whoever uses it (``moto_server``, from the ``moto[server]`` test extra).

The server keeps its buckets in memory: ``restart()`` after ``kill()`` brings back an empty store
(the bucket is created again), which is what an upload must survive."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, bucket: str = "ckpt-tests"):
        self.port = _free_port()
        self.bucket = bucket
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.process = None

    @property
    def env(self) -> dict:
        """The AWS environment that alone points a client at this server."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def start(self) -> None:
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        for _ in range(600):  # the server imports for a few seconds on a busy 2-core VM
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError("moto_server exited at start")
                time.sleep(0.05)
        else:
            raise RuntimeError("moto_server did not start listening")
        self.make_bucket()

    def make_bucket(self) -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, **_lower(CREDENTIALS))
        client.create_bucket(Bucket=self.bucket)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def restart(self) -> None:
        self.kill()
        self.start()

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"


def _lower(env: dict) -> dict:
    return {"aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
            "region_name": env["AWS_DEFAULT_REGION"]}
