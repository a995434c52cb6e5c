"""The Store API, the same round trips on a local directory and on real S3 (SeaweedFS)."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import socket
import sys
import time
from pathlib import Path

import pytest

import storage.store
from core.files import sha256_bytes
from storage import LocalStore, S3Store, Store, open_store, sha256_file
from storage.store import IntegrityError, MiB, RetryPolicy

FAST_RETRY = RetryPolicy(attempts=3, initial_delay=0.05, max_delay=0.2, max_total=5.0)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request, tmp_path) -> Store:
    if request.param == "local":
        return open_store(str(tmp_path / "store"))
    return open_store(request.getfixturevalue("s3_uri"))


def write_random(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return path


def overwrite_behind_store(store: Store, key: str, data: bytes, request, metadata: dict | None = None):
    """Replace the stored bytes of `key` without going through the store, as corruption would."""
    if isinstance(store, LocalStore):
        store.path(key).write_bytes(data)
    else:
        server = request.getfixturevalue("s3_server")
        server.client().put_object(Bucket=store.bucket, Key=f"{store.prefix}/{key}", Body=data,
                                   Metadata=metadata or {})


def make_tree(root: Path) -> dict[str, bytes]:
    """A checkpoint-like directory: data files in subfolders and a manifest at the top."""
    files = {f"shard-{i}.bin": os.urandom(1000 + i) for i in range(4)}
    files |= {"optim/state-0.bin": os.urandom(3000), "optim/deep/state-1.bin": b"", "manifest.json": b"{}"}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_bytes_round_trip(store):
    store.put_bytes("a/b.txt", b"hello")
    assert store.get_bytes("a/b.txt") == b"hello"
    assert store.exists("a/b.txt") and not store.exists("a/c.txt") and not store.exists("a")
    store.put_bytes("a/b.txt", b"replaced")
    assert store.get_bytes("a/b.txt") == b"replaced"


def test_file_round_trip(store, tmp_path):
    src = write_random(tmp_path / "src.bin", 300_000)
    store.put_file(src, "data/src.bin")
    dest = tmp_path / "fresh" / "deeper" / "out.bin"
    store.get_file("data/src.bin", dest)
    assert dest.read_bytes() == src.read_bytes()
    assert os.listdir(dest.parent) == ["out.bin"]  # no partial files left beside it
    store.verify(src, "data/src.bin")


def test_list_is_recursive_sorted_and_scoped_to_folders(store):
    keys = ["z", "ckpt/step-10/a", "ckpt/step-1/sub/b", "ckpt/step-1/a", "ckpt/step-1.txt"]
    for key in keys:
        store.put_bytes(key, key.encode())
    assert store.list() == sorted(keys)
    assert store.list("ckpt/step-1") == ["ckpt/step-1/a", "ckpt/step-1/sub/b"]
    assert store.list("ckpt/step-1/") == ["ckpt/step-1/a", "ckpt/step-1/sub/b"]
    assert store.list("nothing/here") == []
    assert store.sizes("ckpt/step-1") == {"ckpt/step-1/a": 13, "ckpt/step-1/sub/b": 17}
    assert store.sizes("nothing/here") == {}


def test_delete_and_delete_prefix(store):
    for key in ["ckpt/step-1/a", "ckpt/step-1/sub/b", "ckpt/step-10/a", "ckpt/step-1.txt", "top"]:
        store.put_bytes(key, b"x")
    store.delete("top")
    store.delete("top")  # deleting what is gone is fine, so retried deletes succeed
    assert not store.exists("top")
    store.delete_prefix("ckpt/step-1")
    assert store.list() == ["ckpt/step-1.txt", "ckpt/step-10/a"]
    store.delete_prefix("")
    assert store.list() == []


def test_missing_key_raises_file_not_found_naming_the_url(store, tmp_path):
    url = re.escape(store.url("no/such.bin"))
    with pytest.raises(FileNotFoundError, match=url):
        store.get_bytes("no/such.bin")
    with pytest.raises(FileNotFoundError, match=url):
        store.get_file("no/such.bin", tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()
    with pytest.raises(FileNotFoundError):
        store.download_dir("no/such/folder", tmp_path / "dl")


@pytest.mark.parametrize("key", ["", "/abs", "../up", "a/../../b", "a//b", "a/./b"])
def test_keys_that_could_escape_the_root_are_rejected(store, key):
    with pytest.raises(ValueError, match="invalid key"):
        store.put_bytes(key, b"x")


def test_upload_dir_publishes_the_manifest_after_all_data(store, tmp_path):
    files = make_tree(tmp_path / "ckpt")
    order, seen_at_manifest = [], []
    put_file = store.put_file

    def recording_put(local_path, key, **kwargs):
        if key.endswith("manifest.json"):
            seen_at_manifest.extend(store.list("step-5"))
        put_file(local_path, key, **kwargs)
        order.append(key)

    store.put_file = recording_put
    uploaded = store.upload_dir(tmp_path / "ckpt", "step-5")

    data_keys = sorted(f"step-5/{rel}" for rel in files if rel != "manifest.json")
    assert order[-1] == uploaded[-1] == "step-5/manifest.json"
    assert sorted(seen_at_manifest) == data_keys  # every data file was stored before the manifest
    assert sorted(store.list("step-5")) == sorted(data_keys + ["step-5/manifest.json"])


def test_upload_dir_withholds_the_manifest_when_data_fails(store, tmp_path):
    make_tree(tmp_path / "ckpt")
    put_file = store.put_file

    def failing_put(local_path, key, **kwargs):
        if key.endswith("shard-2.bin"):
            raise OSError("disk on fire")
        put_file(local_path, key, **kwargs)

    store.put_file = failing_put
    with pytest.raises(OSError, match="disk on fire"):
        store.upload_dir(tmp_path / "ckpt", "step-5")
    assert not store.exists("step-5/manifest.json")


def test_upload_dir_uses_known_digests_and_checks_them(store, tmp_path, monkeypatch):
    files = make_tree(tmp_path / "ckpt")
    known = {rel: sha256_bytes(data) for rel, data in files.items() if rel != "manifest.json"}
    read_before_upload = []
    real_sha256_file = storage.store.sha256_file

    def recording_sha256_file(path):
        if Path(path).is_relative_to(tmp_path / "ckpt"):  # not LocalStore's check of its copies
            read_before_upload.append(Path(path).relative_to(tmp_path / "ckpt").as_posix())
        return real_sha256_file(path)

    monkeypatch.setattr(storage.store, "sha256_file", recording_sha256_file)
    if isinstance(store, S3Store):
        store.retry = FAST_RETRY
    store.upload_dir(tmp_path / "ckpt", "step-5", known_sha256=known)
    assert read_before_upload == ["manifest.json"]  # the one file without a known digest
    for rel, data in files.items():
        assert store.get_bytes(f"step-5/{rel}") == data

    # A digest that does not match the file is an error naming the key, not a stored claim.
    known["shard-2.bin"] = sha256_bytes(b"other bytes")
    with pytest.raises(IntegrityError, match=r"step-6/shard-2\.bin: sha256 [0-9a-f]{64} != expected"):
        store.upload_dir(tmp_path / "ckpt", "step-6", known_sha256=known)
    assert not store.exists("step-6/manifest.json")
    if isinstance(store, S3Store):
        # S3 received the bytes before their sha256 could be checked; the object is left, but
        # its wrong sha256 metadata keeps any download of it from passing as good.
        with pytest.raises(IntegrityError, match="sha256"):
            store.get_bytes("step-6/shard-2.bin")
    else:
        assert not store.exists("step-6/shard-2.bin")


def test_download_dir_round_trip_fetches_the_manifest_last(store, tmp_path):
    files = make_tree(tmp_path / "ckpt")
    store.upload_dir(tmp_path / "ckpt", "runs/step-5")
    local = tmp_path / "restored"
    present_at_manifest = []
    get_file = store.get_file

    def recording_get(key, local_path):
        if key.endswith("manifest.json"):
            present_at_manifest.extend(p for p in local.rglob("*") if p.is_file())
        get_file(key, local_path)

    store.get_file = recording_get
    fetched = store.download_dir("runs/step-5", local)

    assert fetched[-1] == "runs/step-5/manifest.json"
    assert len(present_at_manifest) == len(files) - 1
    assert {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()} == files


def test_verify_detects_a_changed_object(store, tmp_path, request):
    src = write_random(tmp_path / "src.bin", 10_000)
    store.put_file(src, "obj.bin")
    store.verify(src, "obj.bin")
    overwrite_behind_store(store, "obj.bin", os.urandom(10_000), request)  # same size, other bytes
    with pytest.raises(IntegrityError, match="obj.bin"):
        store.verify(src, "obj.bin")


@pytest.mark.s3
def test_download_detects_bytes_that_do_not_match_their_checksum(s3_uri, tmp_path, request):
    store = S3Store(s3_uri, retry=FAST_RETRY)
    src = write_random(tmp_path / "src.bin", 10_000)
    store.put_file(src, "obj.bin")
    # Same size and the original sha256 in metadata, but other bytes: what bit rot looks like.
    overwrite_behind_store(store, "obj.bin", os.urandom(10_000), request, {"sha256": sha256_file(src)})
    with pytest.raises(IntegrityError, match="sha256"):
        store.get_file("obj.bin", tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()
    with pytest.raises(IntegrityError, match="sha256"):
        store.get_bytes("obj.bin")


@pytest.mark.s3
def test_multipart_upload_is_verified(s3_server, s3_uri, tmp_path):
    store = S3Store(s3_uri, part_size=5 * MiB)
    src = write_random(tmp_path / "big.bin", 12 * MiB + 123)  # three parts: 5 + 5 + 2 MiB
    store.put_file(src, "big.bin")

    head = s3_server.client().head_object(Bucket=store.bucket, Key=f"{store.prefix}/big.bin",
                                          ChecksumMode="ENABLED")
    # checked against the composite CRC32 computed while the parts were read for sending
    assert head["ChecksumCRC32"].endswith("-3") and head["ChecksumType"] == "COMPOSITE"
    assert head["Metadata"]["sha256"] == sha256_file(src)
    store.verify(src, "big.bin")
    store.get_file("big.bin", tmp_path / "back.bin")
    assert sha256_file(tmp_path / "back.bin") == sha256_file(src)


@pytest.mark.s3
@pytest.mark.parametrize("checksums", ["crc32", "etag"])
def test_verify_reads_the_part_size_the_object_was_uploaded_with(s3_uri, tmp_path, checksums):
    """An object uploaded in 5 MiB parts verifies with a store of 8 MiB parts (storage.part_size
    changed since, or another tool uploaded it): its composite CRC32 / ETag are of 3 parts."""
    src = write_random(tmp_path / "big.bin", 12 * MiB + 123)
    S3Store(s3_uri, part_size=5 * MiB).put_file(src, "big.bin")
    checker = S3Store(s3_uri, part_size=8 * MiB, retry=FAST_RETRY)
    if checksums == "etag":
        checker = _without_checksums(checker)
    checker.verify(src, "big.bin")
    other = write_random(tmp_path / "other.bin", 12 * MiB + 123)
    with pytest.raises(IntegrityError, match=r"-3 != expected \S+-3"):
        checker.verify(other, "big.bin")


def _without_checksums(store):
    """`store` talking to a server that keeps no CRC32 for its objects (older S3-compatible ones)."""
    head_digest = store._head_digest
    store._head_digest = lambda key: {**head_digest(key), "crc32": None}
    return store


@pytest.mark.s3
@pytest.mark.parametrize("times", [1, 3])
@pytest.mark.parametrize("server_keeps", ["crc32", "etag"])
def test_a_part_changed_before_it_was_checksummed_is_caught_after_upload(s3_uri, tmp_path, caplog,
                                                                       times, server_keeps):
    store = S3Store(s3_uri, part_size=5 * MiB, retry=FAST_RETRY)
    if server_keeps == "etag":
        _without_checksums(store)
    src = write_random(tmp_path / "big.bin", 12 * MiB + 123)
    corrupted = []

    def flip_a_byte_of_part_2(params, **_):
        # Before botocore computes the request's own checksum: S3 accepts the part as sent.
        if params["PartNumber"] == 2 and len(corrupted) < times:
            data = bytearray(params["Body"].read())
            data[1000] ^= 0xFF
            params["Body"] = io.BytesIO(bytes(data))
            corrupted.append(params["UploadId"])

    store._client.meta.events.register("before-parameter-build.s3.UploadPart", flip_a_byte_of_part_2)
    if times < FAST_RETRY.attempts:  # a whole-file retry recovers
        store.put_file(src, "big.bin")
        assert len(corrupted) == times
        assert f"{server_keeps} " in caplog.text and "retrying" in caplog.text
        store.get_file("big.bin", tmp_path / "back.bin")
        assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    else:
        with pytest.raises(IntegrityError, match=rf"big\.bin: {server_keeps} \S+-3 != expected \S+-3"):
            store.put_file(src, "big.bin")
        assert len(set(corrupted)) == FAST_RETRY.attempts  # each attempt a new multipart upload


@pytest.mark.s3
@pytest.mark.parametrize("times", [1, 3])
def test_a_part_damaged_on_the_wire_is_refused_by_the_server_and_sent_again(s3_uri, tmp_path, caplog, times):
    store = S3Store(s3_uri, part_size=5 * MiB, retry=FAST_RETRY)
    src = write_random(tmp_path / "big.bin", 12 * MiB + 123)
    damaged = []

    def flip_a_byte_on_the_wire(request, **_):
        # After botocore computed the part's CRC32 (and signed it): what a bad NIC or proxy does.
        if "partNumber=2" in request.url and len(damaged) < times:
            body = request.body.read() if hasattr(request.body, "read") else bytes(request.body)
            data = bytearray(body)
            data[1000] ^= 0xFF
            request.body = bytes(data)
            damaged.append(request.url)

    store._client.meta.events.register("before-send.s3.UploadPart", flip_a_byte_on_the_wire)
    if times < FAST_RETRY.attempts:
        store.put_file(src, "big.bin")
        assert len(damaged) == times and "retrying" in caplog.text
        store.get_file("big.bin", tmp_path / "back.bin")
        assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    else:
        with pytest.raises(IntegrityError, match=r"big\.bin: the server received other bytes than were sent"):
            store.put_file(src, "big.bin")
        assert not store.exists("big.bin")


@pytest.mark.s3
def test_verify_falls_back_to_the_etag_where_the_server_keeps_no_checksum(s3_uri, tmp_path, request):
    store = _without_checksums(S3Store(s3_uri, part_size=5 * MiB))
    src = write_random(tmp_path / "big.bin", 12 * MiB + 123)
    store.put_file(src, "big.bin")
    store.verify(src, "big.bin")
    other = write_random(tmp_path / "other.bin", 12 * MiB + 123)
    with pytest.raises(IntegrityError, match=r"etag \S+-3 != expected \S+-3"):
        store.verify(other, "big.bin")


@pytest.mark.s3
def test_put_bytes_checks_the_crc32_not_the_etag_which_encryption_changes(s3_uri):
    """Objects encrypted with SSE-KMS or SSE-C get an ETag that is no md5 of their bytes (AWS;
    SeaweedFS has no KMS, so its HEAD is shown one): small writes (the ledger) must not fail
    on it, while a stored CRC32 that differs still does."""
    store = S3Store(s3_uri, retry=RetryPolicy(attempts=1))
    head_digest = store._head_digest
    store._head_digest = lambda key: {**head_digest(key), "etag": "a6f1c0b4e0d2c5b7a9f8e7d6c5b4a3f2"}
    store.put_bytes("ledger.json", b'{"entries": {}}')
    assert store.get_bytes("ledger.json") == b'{"entries": {}}'

    store._head_digest = lambda key: {**head_digest(key), "crc32": "AAAAAA=="}
    with pytest.raises(IntegrityError, match="crc32 AAAAAA== != expected"):
        store.put_bytes("ledger.json", b'{"entries": {"1": {}}}')

    store = _without_checksums(S3Store(s3_uri, retry=RetryPolicy(attempts=1)))  # the ETag is all there is
    store.put_bytes("plain.json", b"{}")
    head_digest = store._head_digest
    store._head_digest = lambda key: {**head_digest(key), "etag": "0" * 32}
    with pytest.raises(IntegrityError, match="etag 0+ != expected"):
        store.put_bytes("plain.json", b"{}")


@pytest.mark.s3
@pytest.mark.parametrize("access_key", ["server", "unknown-key-id"])
def test_wrong_credentials_are_refused_without_retrying(s3_server, s3_uri, monkeypatch, tmp_path, access_key):
    secret = "not-the-secret-0123"
    src = write_random(tmp_path / "src.bin", 100)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key if access_key == "server" else access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    store = open_store(s3_uri)
    start = time.monotonic()
    operations = [
        lambda: store.put_bytes("x", b"1"),
        lambda: store.put_file(src, "x"),  # a managed transfer (s3transfer) in between
        lambda: store.get_bytes("x"),
        lambda: store.get_file("x", tmp_path / "out"),
        lambda: store.exists("x"),  # a HEAD: a bare 403 without an error code
        lambda: store.list(),
    ]
    for operation in operations:
        with pytest.raises(PermissionError, match="refused the credentials") as refused:
            operation()
        assert "AWS_ACCESS_KEY_ID" in str(refused.value)
        assert secret not in str(refused.value) and secret not in repr(store)
        assert refused.value.__cause__ is None and refused.value.__suppress_context__
    assert time.monotonic() - start < 2


@pytest.mark.s3
def test_missing_credentials_are_reported(s3_uri, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(PermissionError, match="no AWS credentials"):
        open_store(s3_uri).put_bytes("x", b"1")


def test_transient_errors_are_retried_with_backoff_then_reported(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "any")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "any")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    policy = RetryPolicy(attempts=3, initial_delay=0.1, max_delay=1.0, max_total=10.0)
    store = S3Store("s3://bucket/x", endpoint_url=dead, region="us-east-1", request_attempts=1, retry=policy)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"after 3 attempts.*check that {dead} is the store's "
                       "endpoint \\(storage.endpoint_url"):
        store.put_bytes("k", b"1")
    assert time.monotonic() - start >= 0.15  # two backoffs: >= 0.05 + 0.1 with jitter

    bounded = S3Store("s3://bucket/x", endpoint_url=dead, region="us-east-1", request_attempts=1,
                      retry=RetryPolicy(attempts=50, initial_delay=0.1, max_delay=0.2, max_total=0.5))
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=r"after \d attempts"):  # far fewer than 50
        bounded.get_bytes("k")
    assert time.monotonic() - start < 1.5


@pytest.mark.s3
def test_a_store_out_of_reach_is_said_at_once_and_one_that_answers_is_not(s3_server, s3_uri, monkeypatch,
                                                                          tmp_path):
    """Store.out_of_reach: one TCP connection to the endpoint, no request and no credentials;
    the S3 calls' retries took about a minute to say the same."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()
    why = S3Store("s3://bucket/x", endpoint_url=dead, region="us-east-1").out_of_reach(within_s=1.0)
    assert time.monotonic() - start < 3
    assert why.startswith(f"the store s3://bucket/x cannot be reached at {dead}: nothing listens on")
    assert "storage.endpoint_url" in why
    nameless = S3Store("s3://bucket/x", endpoint_url="http://no-such-host.invalid:8333", region="us-east-1")
    assert "the host name 'no-such-host.invalid' does not resolve" in nameless.out_of_reach(within_s=0)

    assert open_store(s3_uri).out_of_reach() is None  # SeaweedFS answers
    assert LocalStore(tmp_path).out_of_reach() is None
    # Through a proxy boto3 reaches what this machine may not: the endpoint is not dialled.
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:3128")
    assert S3Store("s3://bucket/x", endpoint_url=dead, region="us-east-1").out_of_reach(within_s=0) is None


def test_open_store_accepts_paths_file_uris_and_s3(tmp_path):
    assert open_store(str(tmp_path)).root == tmp_path
    assert open_store(tmp_path.as_uri()).root == tmp_path
    assert open_store(str(tmp_path)).url("a/b c") == (tmp_path / "a/b c").as_uri()
    s3 = open_store("s3://bucket/runs/one/", region="us-east-1")
    assert (s3.bucket, s3.prefix) == ("bucket", "runs/one")
    assert s3.url("step-1/m.json") == "s3://bucket/runs/one/step-1/m.json"


def test_s3_uris_keep_question_marks_and_hashes_in_keys():
    # Legal in S3 keys; read as a URL's query or fragment they would name another key.
    from core.uris import parse_s3_uri
    assert parse_s3_uri("s3://bucket/a/part#1.jsonl") == ("bucket", "a/part#1.jsonl")
    assert parse_s3_uri("s3://bucket/a/b?c/*.jsonl") == ("bucket", "a/b?c/*.jsonl")
    assert parse_s3_uri("s3://bucket") == ("bucket", "")


@pytest.mark.parametrize(
    "uri", ["http://host/x", "gs://bucket/x", "s3://", "s3:///nobucket", "file://otherhost/x"]
)
def test_open_store_rejects_other_uris(uri):
    with pytest.raises(ValueError, match=re.escape(repr(uri))) as error:
        open_store(uri)
    assert "s3://bucket" in str(error.value) or "file:///" in str(error.value)


# -- background priority (core.cpu_priority) ----------------------------------------------------

def _priority_of_this_thread() -> tuple[int, int]:
    """(scheduling policy, nice value) of the calling thread."""
    import threading

    thread = threading.get_native_id()
    return os.sched_getscheduler(thread), os.getpriority(os.PRIO_PROCESS, thread)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_background_work_runs_at_the_lowest_priority_and_leaves_the_caller_alone():
    import threading

    from core.cpu_priority import BACKGROUND_NICE, at_background_priority, lower_thread_priority

    probe = []
    threading.Thread(target=lambda: probe.append(lower_thread_priority())).start()
    while not probe:
        time.sleep(0.01)
    if not probe[0]:
        pytest.skip("this sandbox forbids lowering a thread's scheduling class")
    caller = _priority_of_this_thread()
    seen = {}

    def work(x):
        seen["work"] = _priority_of_this_thread()
        # A thread the background work starts (DCP's and boto3's pool threads) inherits it.
        child = threading.Thread(target=lambda: seen.update(child=_priority_of_this_thread()))
        child.start()
        child.join()
        return x * 2

    assert at_background_priority(work, 21) == 42
    background = (os.SCHED_IDLE, BACKGROUND_NICE)
    assert seen == {"work": background, "child": background}
    assert _priority_of_this_thread() == caller  # the caller (a Prefect worker thread) is unchanged


def test_background_work_hands_its_exception_to_the_caller():
    from core.cpu_priority import at_background_priority

    def fails():
        raise ConnectionError("store down")

    with pytest.raises(ConnectionError, match="store down"):
        at_background_priority(fails)


# -- reading data sources in place: list_objects, open_read ------------------------------------

@pytest.mark.s3
def test_list_objects_takes_a_plain_prefix_and_gives_sizes_and_etags(s3_uri):
    store = S3Store(s3_uri)
    for key, data in {"data/x.jsonl": b"12345", "data/x.jsonl.gz": b"1", "data2/y": b"", "z": b"7"}.items():
        store.put_bytes(key, data)
    listed = store.list_objects("data")
    assert [(key, size) for key, size, _ in listed] == [("data/x.jsonl", 5), ("data/x.jsonl.gz", 1), ("data2/y", 0)]
    assert listed[0][2] == hashlib.md5(b"12345").hexdigest()  # a one-PUT object's ETag, unquoted
    assert [key for key, _, _ in store.list_objects("data/")] == ["data/x.jsonl", "data/x.jsonl.gz"]
    assert len(store.list_objects()) == 4 and store.list_objects("nothing/") == []


@pytest.mark.s3
def test_open_read_reads_ranges_ahead_and_seeks(s3_uri):
    store = S3Store(s3_uri)
    data = os.urandom(3 * MiB + 123)
    store.put_bytes("blob", data)
    ranges = []
    store._client.meta.events.register("before-parameter-build.s3.GetObject",
                                       lambda params, **_: ranges.append(params["Range"]))
    with store.open_read("blob", 100, buffer_size=MiB) as f:
        assert f.tell() == 100
        assert b"".join(f.read(1000) for _ in range(1500)) == data[100:1_500_100]
        # a GET per MiB read ahead, not one per small read
        assert ranges == [f"bytes=100-{100 + MiB - 1}", f"bytes={100 + MiB}-{100 + 2 * MiB - 1}"]
        f.seek(-10, os.SEEK_END)
        assert f.read() == data[-10:] and f.read(5) == b""
    ranges.clear()
    with store.open_read("blob", 10, 20) as f:
        assert f.read() == data[10:20]
    assert ranges == ["bytes=10-19"]
    with pytest.raises(storage.store.ObjectChangedError, match="changed: its ETag is"):
        store.open_read("blob", etag="not-the-etag")


@pytest.mark.s3
def test_open_read_refuses_to_mix_versions_and_names_a_vanished_object(s3_uri):
    store = S3Store(s3_uri, retry=FAST_RETRY)
    store.put_bytes("blob", os.urandom(2 * MiB))
    with store.open_read("blob", buffer_size=MiB) as f:
        f.read(10)
        store.put_bytes("blob", os.urandom(2 * MiB))  # replaced between two ranged GETs
        with pytest.raises(storage.store.ObjectChangedError, match="blob changed while being read"):
            f.read(2 * MiB)
    with store.open_read("blob") as f:
        store.delete("blob")
        with pytest.raises(FileNotFoundError, match=f"no such object: {re.escape(store.url('blob'))}"):
            f.read(1)


def test_a_damaged_local_ledger_is_set_aside_and_the_stores_copy_takes_its_place(tmp_path, caplog):
    """A ledger.json damaged on disk (truncated here) failed every command of the run with a
    pydantic error, and the warning blamed the store: reading it names the file, and the next
    restore sets it aside (under the ledger's lock) and takes the store's copy."""
    from core.config import load_config
    from goodput.checkpoint_lifecycle import ledger_of, restore_ledger
    from storage.store import store_from_config

    config = load_config(None, [f"run.runs_dir={tmp_path / 'runs'}", f"storage.uri={tmp_path / 'store'}"])
    store = store_from_config(config.storage)
    ledger = ledger_of(config)
    ledger.path.parent.mkdir(parents=True)
    ledger.record(10, "committed", loss=3.0)
    ledger.record(10, "validated")
    ledger.add_data_skip(160, 320, "non-finite loss at step 11")
    ledger.push(store)
    ledger.path.write_bytes(ledger.path.read_bytes()[:200])  # truncated
    from storage.ledger import LedgerDamaged

    with pytest.raises(LedgerDamaged, match=re.escape(f"the ledger {ledger.path} is damaged")):
        ledger.read()  # every reader, the workers too, until the next run repairs it

    with caplog.at_level(logging.WARNING, logger="storage.ledger"):
        restore_ledger(config, store)
    data = ledger.read()
    assert data.steps("validated") == [10] and [(s.start, s.end) for s in data.data_skips] == [(160, 320)]
    [aside] = ledger.path.parent.glob("ledger.json.damaged-*")
    assert f"the ledger {ledger.path} is damaged" in caplog.text and aside.name in caplog.text


def _unfinished_uploads(s3_server, store: S3Store, folder: str) -> dict[str, list[int]]:
    """Multipart uploads under `folder` started and neither completed nor aborted: key -> part sizes."""
    client = s3_server.client()
    listed = client.list_multipart_uploads(Bucket=store.bucket, Prefix=f"{store.prefix}/{folder}")
    return {u["UploadId"]: [p["Size"] for p in client.list_parts(
                Bucket=store.bucket, Key=u["Key"], UploadId=u["UploadId"]).get("Parts", [])]
            for u in listed.get("Uploads", [])}


def _start_unfinished_upload(s3_server, store: S3Store, key: str, size: int = 5 * MiB) -> str:
    client = s3_server.client()
    full = f"{store.prefix}/{key}"
    upload = client.create_multipart_upload(Bucket=store.bucket, Key=full)["UploadId"]
    client.upload_part(Bucket=store.bucket, Key=full, UploadId=upload, PartNumber=1, Body=os.urandom(size))
    return upload


_KILLED_MID_UPLOAD = """
import os, signal, sys
from storage.store import S3Store, MiB
store = S3Store(sys.argv[1], part_size=5 * MiB, max_concurrency=1)
def kill(**_):  # kill -9 once a part of the checkpoint's big file is stored
    os.kill(os.getpid(), signal.SIGKILL)
store._client.meta.events.register("after-call.s3.UploadPart", kill)
store.upload_dir(sys.argv[2], "ckpt/step-00000006")
"""


@pytest.mark.s3
def test_an_upload_killed_mid_transfer_has_its_parts_aborted_by_the_next_upload_of_the_folder(
        s3_server, s3_uri, tmp_path, caplog):
    """kill -9 during a multipart upload leaves its parts stored (and billed, on AWS) with no
    process left to abort them. The next upload of the same checkpoint folder, asking for it
    (abort_unfinished, as the checkpoint upload does), aborts those started before it, says how
    much was left, and leaves every other upload alone: one under another folder, and one
    started after it began (another live uploader's). Without asking (a dataset's shards,
    which other workers may be writing into the same folder right now) none is touched."""
    import subprocess

    checkpoint = tmp_path / "step-00000006"
    write_random(checkpoint / "__0_0.distcp", 12 * MiB + 123)
    (checkpoint / "manifest.json").write_bytes(b"{}")
    proc = subprocess.run([sys.executable, "-c", _KILLED_MID_UPLOAD, s3_uri, str(checkpoint)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    store = S3Store(s3_uri, part_size=5 * MiB)
    left = _unfinished_uploads(s3_server, store, "ckpt/step-00000006/")
    assert len(left) == 1 and sum(len(p) for p in left.values()) >= 1, left
    parts, size = sum(len(p) for p in left.values()), sum(sum(p) for p in left.values())
    elsewhere = _start_unfinished_upload(s3_server, store, "ckpt/step-00000007/__0_0.distcp")
    with caplog.at_level(logging.WARNING, logger="storage.store"):
        store.upload_dir(checkpoint, "ckpt/step-00000006")  # not asked: a live writer's may be among them
    assert _unfinished_uploads(s3_server, store, "ckpt/step-00000006/") == left
    assert "unfinished" not in caplog.text

    live = []

    def another_uploader_starts(**_):  # while this upload runs: not this upload's to abort
        if not live:
            live.append(_start_unfinished_upload(s3_server, store, "ckpt/step-00000006/__1_0.distcp"))

    store._client.meta.events.register("before-call.s3.CreateMultipartUpload", another_uploader_starts)
    with caplog.at_level(logging.WARNING, logger="storage.store"):
        store.upload_dir(checkpoint, "ckpt/step-00000006", abort_unfinished=True)
    assert set(_unfinished_uploads(s3_server, store, "ckpt/step-00000006/")) == set(live)
    assert set(_unfinished_uploads(s3_server, store, "ckpt/step-00000007/")) == {elsewhere}
    assert re.search(rf"aborted 1 unfinished multipart upload .*ckpt/step-00000006/.*: {parts} parts?, "
                     rf"{size} bytes", caplog.text), caplog.text
    store.verify(checkpoint / "__0_0.distcp", "ckpt/step-00000006/__0_0.distcp")
    # Nothing of the kind on a local store, and nothing to say where nothing was left.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="storage.store"):
        open_store(str(tmp_path / "local")).upload_dir(checkpoint, "ckpt/step-00000006", abort_unfinished=True)
        S3Store(s3_uri, part_size=5 * MiB).upload_dir(checkpoint, "ckpt/step-00000008", abort_unfinished=True)
    assert "unfinished" not in caplog.text
    for upload, key in ((elsewhere, "ckpt/step-00000007/__0_0.distcp"), (live[0], "ckpt/step-00000006/__1_0.distcp")):
        s3_server.client().abort_multipart_upload(Bucket=store.bucket, Key=f"{store.prefix}/{key}", UploadId=upload)


@pytest.mark.s3
def test_an_upload_that_fails_in_a_living_process_leaves_no_unfinished_multipart_upload(
        s3_server, s3_uri, tmp_path):
    """s3transfer aborts the multipart upload of a transfer that fails: no parts stay behind."""
    store = S3Store(s3_uri, part_size=5 * MiB, retry=FAST_RETRY)
    src = write_random(tmp_path / "big.bin", 12 * MiB + 123)

    def disk_error_on_part_2(params, **_):
        if params["PartNumber"] == 2:
            raise OSError("Input/output error reading the file")

    store._client.meta.events.register("before-parameter-build.s3.UploadPart", disk_error_on_part_2)
    with pytest.raises(OSError, match="Input/output error"):
        store.put_file(src, "failed/big.bin")
    assert _unfinished_uploads(s3_server, store, "failed/") == {}
    assert not store.exists("failed/big.bin")
