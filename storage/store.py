"""One storage API over local directories and S3 (see shared/DESIGN.md, section 6).

Stages hand data to each other through a `Store`: a root (`/runs/x`, `file:///runs/x` or
`s3://bucket/prefix`) holding objects under "/"-separated keys. Every write is verified
(size and checksum of what was stored), every read of a missing key raises
`FileNotFoundError` naming the full URL, and a directory is published with its manifest
last, so a reader that sees `manifest.json` can trust that everything it lists is there.

S3 credentials come only from the standard AWS chain (environment, profile, instance role);
this module never takes, stores or prints them.
"""

from __future__ import annotations

import base64
import contextvars
import hashlib
import io
import logging
import os
import random
import re
import shutil
import socket
import time
import urllib.request
import uuid
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar
from urllib.parse import unquote, urlparse

from core.files import fsync_dir, sha256_bytes, sha256_file
from core.uris import check_bucket, check_key, parse_s3_uri  # noqa: F401 (check_bucket: API)

log = logging.getLogger(__name__)

MiB = 1024 * 1024
MANIFEST_LAST = ("manifest.json",)
# In-flight files carry this suffix (and a leading dot) until they are renamed into place.
_PARTIAL_SUFFIX = ".partial"
_T = TypeVar("_T")


class IntegrityError(OSError):
    """What was stored or fetched differs from what was sent (size or checksum)."""


class ObjectChangedError(OSError):
    """An object was replaced while a reader read it (its ETag is no longer the one read)."""


def open_store(uri: str, *, endpoint_url: str | None = None, region: str | None = None,
               part_size: int = 8 * MiB, max_concurrency: int = 10) -> Store:
    """The store for `uri`: a plain path or `file://` URI, or `s3://bucket[/prefix]`.

    The other arguments only matter for S3 (see S3Store); without `endpoint_url` and
    `region` boto3 reads AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL and AWS_DEFAULT_REGION like
    any AWS tool.
    """
    scheme = urlparse(uri).scheme
    if scheme in ("", "file"):
        return LocalStore(uri)
    if scheme == "s3":
        return S3Store(uri, endpoint_url=endpoint_url, region=region, part_size=part_size,
                       max_concurrency=max_concurrency)
    raise ValueError(
        f"unsupported store URI {uri!r}: expected a local path, file:///abs/path or s3://bucket[/prefix]"
    )


def store_from_config(section) -> Store:
    """The store a RunConfig's `storage` section describes."""
    from core.config import parse_bytes

    return open_store(section.uri, endpoint_url=section.endpoint_url, region=section.region,
                      part_size=parse_bytes(section.part_size),
                      max_concurrency=section.max_concurrency)


def store_uri(uri: str) -> str:
    """The URI a store opened on `uri` names itself by (Store.uri), without opening it."""
    if urlparse(uri).scheme == "s3":
        bucket, prefix = parse_s3_uri(uri)
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    return LocalStore(uri).uri


def usable_anywhere(section):
    """A `storage` config section as a process in another working directory must see it (a
    torchrun worker, a Ray task): a local store's root made absolute; s3:// as it is."""
    if urlparse(section.uri).scheme == "s3":
        return section
    return section.model_copy(update={"uri": LocalStore(section.uri).uri})


def _folder(prefix: str) -> str:
    """`prefix` as a folder ("a/b" -> "a/b/"), so "step-1" never matches "step-10/..."."""
    prefix = prefix.strip("/")
    return f"{check_key(prefix)}/" if prefix else ""


def _join(prefix: str, rel: str) -> str:
    return f"{prefix.strip('/')}/{rel}" if prefix.strip("/") else rel


class Store(ABC):
    """Objects under "/"-separated keys below one root URI.

    Prefixes name folders: `list("ckpt/step-1")` returns keys under `ckpt/step-1/` and never
    those of `ckpt/step-10`. `delete` of a missing key does nothing, so retried deletes succeed.
    """

    uri: str

    def url(self, key: str) -> str:
        """Full URI of `key`, as used in error messages and logs."""
        return f"{self.uri}/{check_key(key)}"

    @abstractmethod
    def put_file(self, local_path: str | os.PathLike, key: str, *, sha256: str | None = None) -> None:
        """Store a local file under `key` and verify the stored copy.

        `sha256` is the file's digest when the caller knows it already (from a manifest): the
        file is then not read once more before it goes out, and the copy is still checked
        against it, so a wrong digest raises `IntegrityError` instead of being stored.
        """

    @abstractmethod
    def get_file(self, key: str, local_path: str | os.PathLike) -> None:
        """Fetch `key` into `local_path` (parents created); the file appears whole or not at all."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Every key under folder `prefix`, recursively, relative to the store root, sorted."""

    @abstractmethod
    def sizes(self, prefix: str = "") -> dict[str, int]:
        """`list(prefix)` with each object's size in bytes, from the same one listing."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under folder `prefix` ("" empties the store)."""

    @abstractmethod
    def verify(self, local_path: str | os.PathLike, key: str) -> None:
        """Raise `IntegrityError` unless `key` holds exactly the bytes of `local_path`."""

    def out_of_reach(self, within_s: float = 0.0) -> str | None:
        """Why this machine cannot reach the store at all, else None. A local store is here."""
        return None

    def upload_dir(
        self,
        local_dir: str | os.PathLike,
        prefix: str,
        *,
        last: tuple[str, ...] = MANIFEST_LAST,
        max_workers: int = 4,
        known_sha256: Mapping[str, str] | None = None,
        abort_unfinished: bool = False,
    ) -> list[str]:
        """Upload every file under `local_dir` to folder `prefix`; return the keys in upload order.

        Files named in `last` go up only after all others succeeded, so a manifest is never
        visible before its data; if any data file fails, the manifest is not uploaded.
        `known_sha256` maps paths relative to `local_dir` to digests the caller already has
        (a checkpoint manifest's); each is passed to `put_file`, which checks it.
        `abort_unfinished`: first abort the unfinished multipart uploads under `prefix` (on S3,
        S3Store.upload_dir; a local store has none), only for a caller that is the folder's
        sole writer; off by default.
        """
        root = Path(local_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"no such directory: {root}")
        rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        first, final = _split_last(rels, last)
        known = known_sha256 or {}
        for batch in (first, final):
            _run_parallel([lambda r=r: self.put_file(root / r, _join(prefix, r), sha256=known.get(r))
                           for r in batch], max_workers)
        return [_join(prefix, r) for r in first + final]

    def download_dir(
        self,
        prefix: str,
        local_dir: str | os.PathLike,
        *,
        last: tuple[str, ...] = MANIFEST_LAST,
        max_workers: int = 4,
    ) -> list[str]:
        """Download folder `prefix` into `local_dir`; return the keys in download order.

        Files named in `last` arrive only after all others, so a local reader never sees a
        manifest whose data is still missing. `get_file` verifies each file's size (and, on
        S3, its sha256 when the object carries one).
        """
        folder = _folder(prefix)
        keys = self.list(prefix)
        if not keys:
            raise FileNotFoundError(f"nothing stored under {self.uri}/{folder}")
        first, final = _split_last(keys, last)
        root = Path(local_dir)
        for batch in (first, final):
            _run_parallel([lambda k=k: self.get_file(k, root / k[len(folder) :]) for k in batch], max_workers)
        return first + final


def _split_last(paths: list[str], last: tuple[str, ...]) -> tuple[list[str], list[str]]:
    first = [p for p in paths if p.rsplit("/", 1)[-1] not in last]
    final = [p for p in paths if p.rsplit("/", 1)[-1] in last]
    return first, final


def _run_parallel(jobs: list[Callable[[], None]], max_workers: int) -> None:
    """Run `jobs` on a thread pool; the first failure cancels what has not started and is raised."""
    if not jobs:
        return
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        # Each in a copy of the caller's context: a retry's warning still knows its flow run.
        futures = [pool.submit(contextvars.copy_context().run, job) for job in jobs]
        try:
            for future in as_completed(futures):
                future.result()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


@contextmanager
def _atomic_path(dest: Path) -> Iterator[Path]:
    """A temporary path next to `dest`; on success it is fsynced and renamed onto `dest`.

    Readers see the old file or the complete new one, never a part; on failure the
    temporary file is removed. Names are unique per call, so threads writing the same
    key do not trample each other's partial files.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkstemp: its 0600 mode would survive the rename; this file gets the umask's.
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:12]}{_PARTIAL_SUFFIX}")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _compare(what: str, url: str, found: dict[str, object], expected: dict[str, object]) -> None:
    """Raise IntegrityError naming each property (size, sha256, crc32, etag) where `found` differs."""
    diffs = [f"{name} {found.get(name)} != expected {want}"
             for name, want in expected.items() if found.get(name) != want]
    if diffs:
        raise IntegrityError(f"{what} {url}: " + "; ".join(diffs))


class LocalStore(Store):
    """A directory on a local or network filesystem; writes are atomic (temp file + rename)."""

    def __init__(self, root: str | os.PathLike):
        text = os.fspath(root)
        if text.startswith("file:"):
            parsed = urlparse(text)
            if parsed.netloc not in ("", "localhost"):
                raise ValueError(f"file URI {text!r} names host {parsed.netloc!r}; use file:///abs/path")
            text = unquote(parsed.path)
        self.root = Path(text).expanduser().absolute()
        self.uri = self.root.as_uri()

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def path(self, key: str) -> Path:
        """Where `key` lives on disk."""
        return self.root / check_key(key)

    def url(self, key: str) -> str:
        return self.path(key).as_uri()

    def _existing(self, key: str) -> Path:
        path = self.path(key)
        if not path.is_file():
            raise FileNotFoundError(f"no such object: {self.url(key)}")
        return path

    def put_file(self, local_path, key, *, sha256=None):
        src = Path(local_path)
        expected = _local_digest(src) if sha256 is None else {"size": src.stat().st_size, "sha256": sha256}
        with _atomic_path(self.path(key)) as tmp:
            shutil.copyfile(src, tmp)
            # Checked before the rename, so a bad copy is never visible under `key`.
            _compare("stored copy", self.url(key), _local_digest(tmp), expected)

    def get_file(self, key, local_path):
        src = self._existing(key)
        with _atomic_path(Path(local_path)) as tmp:
            shutil.copyfile(src, tmp)
            _compare("download of", self.url(key), {"size": tmp.stat().st_size}, {"size": src.stat().st_size})

    def put_bytes(self, key, data):
        with _atomic_path(self.path(key)) as tmp:
            tmp.write_bytes(data)

    def get_bytes(self, key):
        return self._existing(key).read_bytes()

    def exists(self, key):
        return self.path(key).is_file()

    def list(self, prefix=""):
        keys = []
        for dirpath, _, filenames in os.walk(self.root / _folder(prefix)):
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if not (name.startswith(".") and name.endswith(_PARTIAL_SUFFIX)):
                    keys.append(name if rel_dir == "." else f"{rel_dir}/{name}")
        return sorted(keys)

    def sizes(self, prefix=""):
        return {key: self.path(key).stat().st_size for key in self.list(prefix)}

    def delete(self, key):
        self.path(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix):
        folder = _folder(prefix)
        if folder:
            shutil.rmtree(self.root / folder, ignore_errors=True)
        else:
            for key in self.list():
                self.delete(key)

    def verify(self, local_path, key):
        stored = _local_digest(self._existing(key))
        _compare("stored copy", self.url(key), stored, _local_digest(Path(local_path)))


def _local_digest(path: Path) -> dict[str, object]:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of whole-file operations, on top of botocore's per-request retries.

    botocore retries single requests; a multipart upload whose part still fails after that
    fails as a whole, and only a retry of the whole transfer recovers it.
    """

    attempts: int = 3
    initial_delay: float = 1.0
    max_delay: float = 15.0
    max_total: float = 120.0  # no new attempt starts after this many seconds

    def delay(self, attempt: int) -> float:
        """Backoff after failed attempt `attempt`, jittered so parallel transfers spread out."""
        return min(self.initial_delay * 2 ** (attempt - 1), self.max_delay) * random.uniform(0.5, 1.0)


# S3 answers a bare "403" (no body) to HEAD requests with refused credentials.
_AUTH_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "Forbidden",
               "ExpiredToken", "InvalidToken"}
_MISSING_CODES = {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                    "ServiceUnavailable"}
# A request whose body does not match its checksum (CRC32, Content-MD5 or the signed sha256).
_DAMAGED_CODES = {"BadDigest", "XAmzContentSHA256Mismatch"}
_CONNECTION_ERRORS: tuple[type[Exception], ...] = ()  # botocore's, set by _import_boto
_CREDENTIALS_HINT = (
    "credentials come from the standard AWS chain: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
    "(and AWS_SESSION_TOKEN), else the profile named by AWS_PROFILE in ~/.aws/credentials, "
    "else an instance or container role"
)


def _import_boto() -> None:
    """boto3, botocore and s3transfer into this module, at the first S3 store: importing them
    took 0.5 s of the start of every process that imports storage (training workers, the
    verifier, each CLI command), most of which never talk to S3. Every use below is in an
    S3Store, after its __init__ called this."""
    global boto3, botocore, Config, TransferConfig, TransferManager, ChunksizeAdjuster
    global _CONNECTION_ERRORS
    import boto3
    import botocore.exceptions
    from botocore.config import Config
    from s3transfer.manager import TransferConfig, TransferManager
    from s3transfer.utils import ChunksizeAdjuster

    _CONNECTION_ERRORS = (botocore.exceptions.HTTPClientError, botocore.exceptions.ConnectionError)


def _root_cause(exc: BaseException) -> BaseException:
    """The botocore error inside boto3/s3transfer wrappers (S3UploadFailedError, RetriesExceededError)."""
    for _ in range(5):
        if isinstance(exc, (botocore.exceptions.ClientError, *_CONNECTION_ERRORS)):
            break
        inner = getattr(exc, "last_exception", None) or exc.__cause__ or exc.__context__
        if inner is None:
            break
        exc = inner
    return exc


class S3Store(Store):
    """Objects in `s3://bucket/prefix` on AWS or any S3-compatible endpoint (SeaweedFS, MinIO).

    Files move through one managed transfer (s3transfer) shared by all of the store's uploads
    and downloads: multipart from `part_size` up, at most `max_concurrency` requests in flight
    in all (as the AWS CLI does; one pool per file would multiply connections, threads and
    buffered parts by the number of files moving at once). Each object carries its sha256 in
    metadata.

    Upload checks, all computed while the transfer reads the file, so hashing overlaps the
    network: botocore sends a CRC32 with every request, which S3 checks on arrival (a part
    damaged on the wire is refused with BadDigest and sent again); what was sent must match the
    file's size and sha256; and the stored object's size, sha256 metadata and CRC32 (composite
    over the parts for a multipart upload) must match what was sent. CRC32 costs a quarter of
    what md5 does here; for a server that keeps no comparable checksum the ETag (md5 per part)
    is checked instead, at the cost of reading the file once more. A download checks the size
    and sha256.
    """

    def __init__(
        self,
        uri: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        part_size: int = 8 * MiB,
        max_concurrency: int = 10,
        request_attempts: int = 5,
        retry: RetryPolicy = RetryPolicy(),
    ):
        _import_boto()
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.retry = retry
        self.transfer = TransferConfig(
            multipart_threshold=part_size, multipart_chunksize=part_size, max_request_concurrency=max_concurrency,
            # parts read but not yet sent, across all uploads: bounds the memory uploads take
            max_in_memory_upload_chunks=max_concurrency,
        )
        config = Config(
            s3={"addressing_style": "path"},
            retries={"mode": "standard", "max_attempts": request_attempts},
            # the shared transfer's requests plus the HEADs and small PUTs of upload_dir's workers
            max_pool_connections=max_concurrency + 8,
            # the default, spelled out: the upload checks above rely on per-request CRC32s
            request_checksum_calculation="when_supported",
        )
        self._client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url, region_name=region, config=config
        )
        self._transfers = TransferManager(self._client, self.transfer)

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r}, endpoint_url={self._client.meta.endpoint_url!r})"

    def _key(self, key: str) -> str:
        return _join(self.prefix, check_key(key))

    def _folder_key(self, prefix: str) -> str:
        return _join(self.prefix, _folder(prefix))

    # -- Store API ------------------------------------------------------------------------

    def put_file(self, local_path, key, *, sha256=None):
        path = Path(local_path)
        if sha256 is None:  # it goes up with the object's first request, so it is needed first
            sha256 = sha256_file(path)

        def upload() -> None:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                part_size = self._part_size(size)
                reader = _DigestingReader(f, part_size)
                # CRC32 named, not left to botocore's default: the check below computes it
                _wait(self._transfers.upload(reader, self.bucket, self._key(key), extra_args={
                    "Metadata": {"sha256": sha256}, "ChecksumAlgorithm": "CRC32"}))
            sent = reader.digest()
            _compare(f"{path} as sent to", self.url(key), sent, {"size": size, "sha256": sha256})
            # The managed transfer does not return S3's responses; one HEAD reads what was stored.
            self._compare_stored(key, path, self._head_digest(key), sent, part_size)

        self._call("upload to", key, upload)

    def upload_dir(self, local_dir, prefix, *, abort_unfinished: bool = False, **kwargs):
        """Store.upload_dir. With `abort_unfinished`, first abort every multipart upload into
        folder `prefix` that is unfinished when it is listed (abort_unfinished_uploads): those a
        killed uploader left, but just as well one a live writer of the folder is still
        sending, whose transfer then fails. So only a caller that is the folder's sole writer
        asks for it: a checkpoint's upload (one per step, under the run's lease), never a
        dataset's publishing (workers and machines may be writing shards of it meanwhile)."""
        if not Path(local_dir).is_dir():
            raise FileNotFoundError(f"no such directory: {local_dir}")
        if abort_unfinished:
            try:
                self.abort_unfinished_uploads(prefix)
            except (PermissionError, ConnectionError) as e:  # e.g. a policy without ListBucketMultipartUploads
                log.warning("could not look for unfinished multipart uploads under %s (%s); uploading anyway",
                            f"{self.uri}/{_folder(prefix)}", e)
        return super().upload_dir(local_dir, prefix, **kwargs)

    def abort_unfinished_uploads(self, prefix: str) -> tuple[int, int, int]:
        """Abort the multipart uploads into folder `prefix` that were started before this call
        and never completed nor aborted; returns (uploads, parts, bytes) abandoned.

        A process killed mid-upload (kill -9, a lost node) leaves its parts stored, billed on
        AWS until a lifecycle rule removes them; a failure in a living process does not (the
        managed transfer aborts its upload). Every upload listed here is aborted, whoever
        started it: S3 cannot tell a dead uploader's from a live one's, so a live writer's
        upload already under way when the listing is made is aborted too (its transfer fails).
        Only an upload begun after the listing is never touched: upload_dir(abort_unfinished=
        True) calls this before its own transfers start, and only for a folder it alone writes.
        """
        folder_key = self._folder_key(prefix)

        def list_unfinished() -> list[dict]:
            found, kwargs = [], {}
            while True:
                response = self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=folder_key, **kwargs)
                found += response.get("Uploads", [])
                if not response.get("IsTruncated"):
                    return found
                kwargs = {"KeyMarker": response["NextKeyMarker"],
                          "UploadIdMarker": response["NextUploadIdMarker"]}

        def abandon(upload: dict) -> list[int] | None:
            """The sizes of the aborted upload's parts; None when it ended meanwhile."""
            ids = {"Bucket": self.bucket, "Key": upload["Key"], "UploadId": upload["UploadId"]}
            try:
                pages = self._client.get_paginator("list_parts").paginate(**ids)
                sizes = [part["Size"] for page in pages for part in page.get("Parts", [])]
                self._client.abort_multipart_upload(**ids)
            except botocore.exceptions.ClientError as e:
                if e.response.get("Error", {}).get("Code") == "NoSuchUpload":
                    return None  # completed or aborted by its own uploader meanwhile
                raise
            return sizes

        listed = self._call("listing of unfinished uploads under", _folder(prefix), list_unfinished)
        strip = len(self.prefix) + 1 if self.prefix else 0
        aborted = [sizes for upload in listed if (sizes := self._call(
            "abort of an unfinished upload to", upload["Key"][strip:], lambda u=upload: abandon(u))) is not None]
        unfinished, parts, size = aborted, sum(map(len, aborted)), sum(map(sum, aborted))
        if unfinished:
            log.warning("aborted %d unfinished multipart upload%s under %s, started before this upload "
                        "by one that never completed (a process killed mid-upload): %d part%s, %d bytes",
                        len(unfinished), "" if len(unfinished) == 1 else "s", f"{self.uri}/{_folder(prefix)}",
                        parts, "" if parts == 1 else "s", size)
        return len(unfinished), parts, size

    def get_file(self, key, local_path):
        def download() -> None:
            stored = self._head_digest(key)
            with _atomic_path(Path(local_path)) as tmp:
                _wait(self._transfers.download(self.bucket, self._key(key), os.fspath(tmp)))
                _compare("download of", self.url(key), _local_digest(tmp), _known(stored, "size", "sha256"))

        self._call("download of", key, download)

    def put_bytes(self, key, data):
        sent = {"size": len(data), "sha256": sha256_bytes(data),
                "crc32": _b64(zlib.crc32(data).to_bytes(4, "big"))}

        def put() -> None:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data,
                                    Metadata={"sha256": sent["sha256"]}, ChecksumAlgorithm="CRC32")
            stored = self._head_digest(key)
            # The stored CRC32, as for files; the ETag (md5 of a one-PUT object) only where the
            # server keeps none: with SSE-KMS or SSE-C the ETag is not an md5 at all.
            expected = sent if stored.get("crc32") is not None else {
                "size": sent["size"], "sha256": sent["sha256"], "etag": hashlib.md5(data).hexdigest()}
            _compare("stored object", self.url(key), stored, expected)

        self._call("upload to", key, put)

    def get_bytes(self, key):
        def get() -> bytes:
            response = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            data = response["Body"].read()
            found = {"size": len(data), "sha256": sha256_bytes(data)}
            expected = _known(_response_digest(response), "size", "sha256")
            _compare("download of", self.url(key), found, expected)
            return data

        return self._call("download of", key, get)

    CONNECT_TIMEOUT_S = 5.0  # an endpoint that takes longer to accept a connection is taken as down

    def out_of_reach(self, within_s: float = 20.0) -> str | None:
        """Why no connection to the endpoint opens (nothing listens there, its name does not
        resolve, no answer in CONNECT_TIMEOUT_S), tried again until `within_s` has passed so
        that a store that is restarting is waited for; None once one opens.

        One TCP connection, no request: it needs no credentials. A wrong endpoint otherwise
        showed after every request's retries and every operation's (about a minute), times
        the task's. Where a proxy carries the requests (HTTPS_PROXY and NO_PROXY, as boto3
        reads them) the endpoint is not dialled: None.
        """
        endpoint = urlparse(self._client.meta.endpoint_url)
        host, port = endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)
        if urllib.request.getproxies().get(endpoint.scheme) and not urllib.request.proxy_bypass(host):
            return None
        started, delay = time.monotonic(), 0.5
        while True:
            try:
                socket.create_connection((host, port), timeout=self.CONNECT_TIMEOUT_S).close()
                return None
            except ConnectionRefusedError:
                why = f"nothing listens on {host}:{port} (connection refused)"
            except socket.gaierror as e:
                why = f"the host name {host!r} does not resolve ({e.strerror})"
            except TimeoutError:
                why = f"{host}:{port} did not answer within {self.CONNECT_TIMEOUT_S:g} s"
            except OSError as e:
                why = f"{host}:{port}: {e.strerror or e}"
            if time.monotonic() + delay > started + within_s:
                return (f"the store {self.uri} cannot be reached at {endpoint.geturl()}: {why}, "
                        f"tried for {time.monotonic() - started:.0f} s. Start the store, or name its endpoint "
                        "(storage.endpoint_url, or AWS_ENDPOINT_URL; unset: AWS)")
            time.sleep(delay)
            delay = min(2 * delay, 5.0)

    def exists(self, key):
        try:
            self._call("lookup of", key, lambda: self._head_digest(key))
        except FileNotFoundError:
            return False
        return True

    def list(self, prefix=""):
        return sorted(self.sizes(prefix))

    def sizes(self, prefix=""):
        folder_key = self._folder_key(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0

        def list_all() -> dict[str, int]:
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=folder_key)
            return {obj["Key"][strip:]: obj["Size"] for page in pages for obj in page.get("Contents", [])}

        return self._call("listing of", prefix, list_all)

    def delete(self, key):
        full_key = self._key(key)
        self._call("delete of", key, lambda: self._client.delete_object(Bucket=self.bucket, Key=full_key))

    def delete_prefix(self, prefix):
        keys = self.list(prefix)
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
            self._call("delete of", prefix, lambda batch=batch: self._delete_batch(batch))

    def _delete_batch(self, batch: list[dict[str, str]]) -> None:
        response = self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
        if errors := response.get("Errors"):
            e = errors[0]
            raise OSError(f"could not delete {len(errors)} objects in {self.uri}, "
                          f"e.g. {e.get('Key')}: {e.get('Code')} {e.get('Message')}")

    def verify(self, local_path, key):
        path = Path(local_path)

        def lookup() -> tuple[dict[str, object], int | None]:
            stored = self._head_digest(key)
            return stored, self._stored_part_size(key, stored)

        # The object may have been uploaded with another part size than this store's (another
        # storage.part_size, another tool): its checksums are those of the parts it has.
        stored, part_size = self._call("lookup of", key, lookup)
        with open(path, "rb") as f:
            reader = _DigestingReader(f, part_size)
            while reader.read(8 * MiB):
                pass
        self._compare_stored(key, path, stored, reader.digest(), part_size)

    # -- reading data sources in place -----------------------------------------------------

    def list_objects(self, prefix: str = "") -> list[tuple[str, int, str]]:
        """(key, size, ETag) of every object whose key starts with `prefix`, sorted by key.

        Unlike `list`, `prefix` is a plain string prefix, not a folder: "data/x" also matches
        "data/x.jsonl" and "data/x2/y"; pass "data/x/" for the folder. Keys are relative to the
        store root, ETags without their quotes. Only the listing is read, never an object.
        """
        if prefix.startswith("/") or ".." in prefix.split("/"):
            raise ValueError(f"invalid prefix {prefix!r}: use a relative 'a/b' path without '..'")
        full_prefix = _join(self.prefix, prefix) if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0

        def list_all() -> list[tuple[str, int, str]]:
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full_prefix)
            return sorted((obj["Key"][strip:], obj["Size"], obj["ETag"].strip('"'))
                          for page in pages for obj in page.get("Contents", []))

        return self._call("listing of", prefix, list_all)

    def open_read(self, key: str, start: int = 0, stop: int | None = None, *, etag: str | None = None,
                  buffer_size: int = 8 * MiB) -> io.BufferedReader:
        """A seekable binary file over the object under `key`, read by ranged GETs.

        Positions are offsets in the object; the file starts at `start` and ends at `stop`
        (None: the object's end). Reads go through a `buffer_size` read-ahead buffer, so
        line-by-line reading costs one request per buffer, and memory stays bounded whatever
        the object's size. Every GET names the version first seen (`etag`, else the one the
        opening HEAD found): a replaced object raises ObjectChangedError, a deleted one
        FileNotFoundError, rather than mixing the bytes of two versions.
        """
        head = self._call("lookup of", key, lambda: self._client.head_object(Bucket=self.bucket, Key=self._key(key)))
        found = head["ETag"].strip('"')
        if etag is not None and found != etag:
            raise ObjectChangedError(f"{self.url(key)} changed: its ETag is {found}, not {etag}")
        size = head["ContentLength"] if stop is None else min(stop, head["ContentLength"])
        raw = _RangeReader(self, key, found, size)
        reader = io.BufferedReader(raw, buffer_size=buffer_size)
        reader.seek(start)
        return reader

    def _get_range(self, key: str, etag: str, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the object under `key` at version `etag` (retried like any call)."""
        def get() -> bytes:
            try:
                response = self._client.get_object(Bucket=self.bucket, Key=self._key(key), IfMatch=f'"{etag}"',
                                                   Range=f"bytes={start}-{stop - 1}")
            except botocore.exceptions.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") == "PreconditionFailed":
                    raise ObjectChangedError(f"{self.url(key)} changed while being read: its ETag "
                                             f"is no longer {etag}") from None
                raise
            data = response["Body"].read()
            if len(data) != stop - start:  # a short body (connection cut): IntegrityError is retried
                raise IntegrityError(f"read of {self.url(key)}: got {len(data)} of {stop - start} bytes")
            return data

        return self._call("read of", key, get)

    # -- checksums ------------------------------------------------------------------------

    def _part_size(self, size: int) -> int | None:
        """The part size an upload of `size` bytes uses with `self.transfer` (None: one PUT).

        s3transfer fits the configured part size to S3's limits (>= 5 MiB, <= 10,000 parts);
        the composite CRC32 and the ETag depend on the part size the upload really uses.
        """
        if size < self.transfer.multipart_threshold:  # the test s3transfer applies
            return None
        return ChunksizeAdjuster().adjust_chunksize(self.transfer.multipart_chunksize, size)

    def _stored_part_size(self, key: str, stored: dict[str, object]) -> int | None:
        """The part size the object under `key` was uploaded with (None: one PUT), from its
        part count ("-N" on its CRC32 or ETag) and the length of its first part (a HEAD of
        part 1). A server that cannot say gets this store's own part size assumed."""
        counts = [m.group(1) for v in (stored.get("crc32"), stored.get("etag"))
                  if v and (m := re.search(r"-(\d+)$", str(v)))]
        if not counts:
            return None
        parts, size = int(counts[0]), int(stored["size"])
        first = self._client.head_object(Bucket=self.bucket, Key=self._key(key), PartNumber=1)
        part_size = int(first["ContentLength"])
        if 0 < part_size and -(-size // part_size) == parts:
            return part_size
        return self._part_size(size)

    def _compare_stored(self, key: str, path: Path, stored: dict[str, object], sent: dict[str, object],
                        part_size: int | None) -> None:
        """Raise IntegrityError unless the object under `key` holds the bytes `sent` describes
        (`path` read in parts of `part_size`, None for one PUT).

        The CRC32 the server reports is compared when it is of the kind computed locally (the
        whole object for one PUT, composite over the parts for multipart). A server that keeps
        none, or one over the whole multipart object, gets its ETag compared instead: md5 of
        `path` read once more. SeaweedFS (4.48) and AWS keep composite CRC32s and standard
        ETags (AWS objects encrypted with SSE-KMS or SSE-C have other ETags and fail the
        fallback).
        """
        crc32 = stored.get("crc32")
        if crc32 is not None and ("-" in crc32) == ("-" in sent["crc32"]):
            expected = sent
        else:
            expected = {"size": sent["size"], "sha256": sent["sha256"],
                        "etag": _s3_etag(path, part_size)}
        _compare("stored object", self.url(key), stored, expected)

    def _head_digest(self, key: str) -> dict[str, object]:
        response = self._client.head_object(Bucket=self.bucket, Key=self._key(key), ChecksumMode="ENABLED")
        return _response_digest(response)

    # -- errors and retries ---------------------------------------------------------------

    def _call(self, what: str, key: str, fn: Callable[[], _T]) -> _T:
        """Run `fn`, one whole operation on `key`, retrying transient failures with backoff.

        A missing object raises FileNotFoundError and refused credentials PermissionError at
        once. Connection errors, 5xx, throttling and checksum mismatches are retried until
        `self.retry` is spent, then raised as ConnectionError / IntegrityError.
        """
        url = f"{self.uri}/{key}" if key else self.uri
        start = time.monotonic()
        for attempt in range(1, self.retry.attempts + 1):
            try:
                return fn()
            except IntegrityError as exc:
                error: OSError = exc
            except Exception as exc:
                error = self._translate(exc, what, url)
                if error is exc:
                    raise
                if not isinstance(error, (ConnectionError, IntegrityError)):
                    raise error from None  # the botocore chain adds nothing and may name the key id
            delay = self.retry.delay(attempt)
            if attempt == self.retry.attempts or time.monotonic() - start + delay > self.retry.max_total:
                break
            log.warning("%s %s failed (attempt %d/%d), retrying in %.1fs: %s",
                        what, url, attempt, self.retry.attempts, delay, error)
            time.sleep(delay)
        if isinstance(error, IntegrityError):
            raise error
        elapsed = time.monotonic() - start
        raise ConnectionError(
            f"{what} {url} failed after {attempt} attempts in {elapsed:.1f}s: {error}; check that "
            f"{self._client.meta.endpoint_url} is the store's endpoint (storage.endpoint_url or "
            "AWS_ENDPOINT_URL name another than AWS) and that it is reachable from here"
        ) from error

    def _translate(self, exc: Exception, what: str, url: str) -> Exception:
        """`exc` as PermissionError, FileNotFoundError, ConnectionError (transient) or itself."""
        if isinstance(exc, botocore.exceptions.NoCredentialsError):
            return PermissionError(f"{what} {url}: no AWS credentials found; {_CREDENTIALS_HINT}")
        cause = _root_cause(exc)
        if isinstance(cause, _CONNECTION_ERRORS):
            return ConnectionError(str(cause))
        if not isinstance(cause, botocore.exceptions.ClientError):
            return exc
        code = cause.response.get("Error", {}).get("Code", "")
        status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if status >= 500 or code in _TRANSIENT_CODES:
            return ConnectionError(f"{code or status}: {cause}")
        if code in _DAMAGED_CODES:  # the bytes that arrived are not those sent: send them again
            return IntegrityError(f"{what} {url}: the server received other bytes than were sent ({code})")
        if status == 403 or code in _AUTH_CODES:
            return PermissionError(
                f"{what} {url}: the S3 endpoint refused the credentials ({code}); {_CREDENTIALS_HINT}"
            )
        if status == 404 or code in _MISSING_CODES:
            if code == "NoSuchBucket":
                return FileNotFoundError(f"bucket {self.bucket!r} does not exist: {url}")
            return FileNotFoundError(f"no such object: {url}")
        return exc


class _RangeReader(io.RawIOBase):
    """The bytes [0, size) of one S3 object version, each read a ranged GET (see open_read)."""

    def __init__(self, store: S3Store, key: str, etag: str, size: int):
        self._store, self._key, self._etag, self._size = store, key, etag, size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer) -> int:
        # No request at or past the end: S3 answers a range there with 416.
        stop = min(self._pos + len(buffer), self._size)
        if stop <= self._pos:
            return 0
        data = self._store._get_range(self._key, self._etag, self._pos, stop)
        buffer[: len(data)] = data
        self._pos = stop
        return len(data)

    def readall(self) -> bytes:
        # RawIOBase's would read 8 KiB, one request, at a time.
        parts = []
        while chunk := self.read(8 * MiB):
            parts.append(chunk)
        return b"".join(parts)


class _DigestingReader:
    """A file being uploaded that computes, as the transfer reads it, its size, sha256 and the
    CRC32 S3 will report for the object: of the whole file for a single PUT, composite for
    multipart (CRC32 of the parts' big-endian CRC32s, plus "-<parts>"), with parts of
    `part_size` bytes.

    s3transfer reads the parts of a file object in order, in one thread; a single PUT's body
    may be read more than once (botocore's checksum pass, a retried request). Only bytes read
    where the hashed prefix ends extend it, so re-read bytes count once, and a read that
    skipped bytes leaves the digest short, which the size check catches.
    """

    def __init__(self, f: BinaryIO, part_size: int | None):
        self._f = f
        self._part_size = part_size
        self._hashed = 0  # bytes from the start of the file hashed so far
        self._sha256 = hashlib.sha256()
        self._crc = 0  # of the current part (of everything for a single PUT)
        self._part_crcs: list[bytes] = []

    def read(self, size: int = -1) -> bytes:
        start = self._f.tell()
        data = self._f.read(size)
        if start <= self._hashed < start + len(data):
            self._hash(memoryview(data)[self._hashed - start :])
        return data

    def _hash(self, new: memoryview) -> None:
        while new:
            room = self._part_size - self._hashed % self._part_size if self._part_size else len(new)
            chunk, new = new[:room], new[room:]
            self._sha256.update(chunk)
            self._crc = zlib.crc32(chunk, self._crc)
            self._hashed += len(chunk)
            if self._part_size and self._hashed % self._part_size == 0:
                self._part_crcs.append(self._crc.to_bytes(4, "big"))
                self._crc = 0

    def digest(self) -> dict[str, object]:
        if self._part_size is None:
            crc32 = _b64(self._crc.to_bytes(4, "big"))
        else:
            parts = self._part_crcs + ([self._crc.to_bytes(4, "big")] if self._hashed % self._part_size else [])
            crc32 = f"{_b64(zlib.crc32(b''.join(parts)).to_bytes(4, 'big'))}-{len(parts)}"
        return {"size": self._hashed, "sha256": self._sha256.hexdigest(), "crc32": crc32}

    # The rest of the file interface that s3transfer and botocore use.
    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self._f.close()


def _response_digest(response: dict) -> dict[str, object]:
    """Size, ETag and, when the object has them, sha256 metadata and CRC32 of a HEAD or GET
    response (the CRC32 only when asked for with ChecksumMode=ENABLED)."""
    return {
        "size": response["ContentLength"],
        "etag": response["ETag"].strip('"'),
        "sha256": response.get("Metadata", {}).get("sha256"),
        "crc32": response.get("ChecksumCRC32"),
    }


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _s3_etag(path: Path, part_size: int | None) -> str:
    """The ETag S3 gives `path` uploaded in parts of `part_size` (None: one PUT): md5 hex of
    the bytes, or of the concatenated binary part md5s plus "-<parts>"."""
    part_md5s = []
    with open(path, "rb") as f:
        while True:  # one part per pass (the whole file for one PUT), read 8 MiB at a time
            md5, read = hashlib.md5(), 0
            while part_size is None or read < part_size:
                chunk = f.read(8 * MiB if part_size is None else min(8 * MiB, part_size - read))
                if not chunk:
                    break
                md5.update(chunk)
                read += len(chunk)
            if part_size is None:
                return md5.hexdigest()
            if not read:
                break
            part_md5s.append(md5.digest())
    return f"{hashlib.md5(b''.join(part_md5s)).hexdigest()}-{len(part_md5s)}"


def _wait(transfer) -> None:
    """The result of an s3transfer future; an interrupted wait cancels the transfer."""
    try:
        transfer.result()
    except BaseException:
        transfer.cancel()
        raise


def _known(stored: dict[str, object], *names: str) -> dict[str, object]:
    """The properties among `names` the object actually records (objects written by other tools
    have no sha256 metadata; then only the size can be checked)."""
    return {name: stored[name] for name in names if stored.get(name) is not None}
