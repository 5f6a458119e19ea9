"""A real S3 API server for tests: moto's server (`moto[server]`, the dev extra) as a subprocess on a free port.

It checks credentials and IAM policies, as S3 does, so a denied bucket is a real 403 from the server: moto answers
the first INITIAL_NO_AUTH_ACTIONS requests without authentication, and `S3Server.start` spends exactly those on
making the bucket and three IAM users with keys — `admin` (everything), `reader` (list and get, never
put) and `nobody` (denied everything) — after which every request is authenticated and authorised.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MOTO_SERVER = Path(sys.executable).with_name("moto_server")
INITIAL_NO_AUTH_ACTIONS = 10  # create_bucket + 3 x (create_user, create_access_key) + 3 policies (put_user_policy)
REGION = "us-east-1"


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, log_path: Path, bucket: str = "lorafleet-adapters"):
        self.bucket, self.port, self.log_path = bucket, _free_port(), log_path
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.users: dict[str, Credentials] = {}

    def start(self) -> S3Server:
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(INITIAL_NO_AUTH_ACTIONS)}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(self.port)], env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited: {self.log_path.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not listen within 60 s") from None
                time.sleep(0.1)
        self._set_up()
        return self

    def _set_up(self) -> None:
        bootstrap = Credentials("bootstrap", "bootstrap")  # any key works for the unauthenticated first actions
        self.client("s3", bootstrap).create_bucket(Bucket=self.bucket)
        iam = self.client("iam", bootstrap)
        objects = [f"arn:aws:s3:::{self.bucket}", f"arn:aws:s3:::{self.bucket}/*"]
        policies = {"admin": {"Effect": "Allow", "Action": "*", "Resource": "*"},
                    # moto authorises HEAD as "s3:HeadObject" (S3 itself: s3:GetObject); ListBucket makes a missing
                    # key a 404 rather than a 403, as on S3
                    "reader": {"Effect": "Allow", "Action": ["s3:GetObject", "s3:HeadObject", "s3:ListBucket"],
                               "Resource": objects},
                    "nobody": {"Effect": "Deny", "Action": "*", "Resource": "*"}}
        for user, statement in policies.items():
            iam.create_user(UserName=user)
            iam.put_user_policy(UserName=user, PolicyName=f"{user}-policy",
                                PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [statement]}))
            key = iam.create_access_key(UserName=user)["AccessKey"]
            self.users[user] = Credentials(key["AccessKeyId"], key["SecretAccessKey"])
        try:  # the unauthenticated allowance is spent: from here on the server checks every request
            iam.list_users()
        except Exception:  # noqa: BLE001 (botocore's ClientError: refused, as it should be)
            return
        raise RuntimeError("moto_server still answers unauthenticated requests; credentials would not be checked")

    def client(self, service: str, creds: Credentials | str = "admin"):
        import boto3

        if isinstance(creds, str):
            creds = self.users[creds]
        return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=creds.access_key, aws_secret_access_key=creds.secret_key)

    def env(self, user: str = "admin", bucket: str | None = None) -> dict[str, str]:
        """The variables config/settings.py reads for S3 storage, as docker-compose.yml sets them for MinIO."""
        creds = self.users[user]
        return {"LORAFLEET_STORAGE": "s3", "AWS_STORAGE_BUCKET_NAME": bucket or self.bucket,
                "AWS_S3_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": creds.access_key,
                "AWS_SECRET_ACCESS_KEY": creds.secret_key, "AWS_S3_REGION_NAME": REGION}

    def keys(self) -> list[str]:
        """Every object key in the bucket, read with the admin's credentials."""
        listing = self.client("s3").list_objects_v2(Bucket=self.bucket)
        return sorted(obj["Key"] for obj in listing.get("Contents", []))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
