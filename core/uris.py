"""Store URIs and keys: what a valid `s3://bucket/prefix`, bucket name and object key look
like, checked without sending any request (servers answer bad names in different ways)."""

from __future__ import annotations

import re


def check_key(key: str) -> str:
    """Reject keys that could escape the store root or mean different things on disk and in S3."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid key {key!r}: use a relative 'a/b/c' path without '.', '..' or '//'")
    return key


# S3's rules for new buckets: 3-63 lowercase letters, digits, '.' and '-', alphanumeric ends.
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """The bucket and prefix of `s3://bucket[/prefix]`, checked (no request is sent).

    Not parsed as a URL: '?' and '#' are ordinary characters of S3 keys (and '?' a glob
    character of data.source), not the start of a query or fragment."""
    scheme, sep, rest = uri.partition("://")
    bucket, _, path = rest.partition("/")
    if scheme.lower() != "s3" or not sep or not bucket:
        raise ValueError(f"not an S3 URI: {uri!r}; expected s3://bucket[/prefix]")
    prefix = path.strip("/")
    if prefix:
        check_key(prefix)
    return check_bucket(bucket), prefix


def check_bucket(name: str) -> str:
    """Reject a bucket name S3 refuses, before any request (servers answer it differently)."""
    if not _BUCKET_NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"invalid S3 bucket name {name!r}: use 3 to 63 lowercase letters, digits, "
                         "'.' and '-', starting and ending with a letter or digit")
    return name


def local_path_of(location: str) -> str:
    """`location` as a local path: a file:// URL's path (as the ledger and the upload log
    name a local store's files), anything else as it is (a path, or a URL of another kind,
    which the caller refuses or reads). A local path whose name holds "://" stays a path."""
    from pathlib import Path
    from urllib.parse import unquote, urlparse

    parsed = urlparse(location)
    if (parsed.scheme == "file" and "://" in location and parsed.netloc in ("", "localhost")
            and not Path(location).exists()):
        return unquote(parsed.path)
    return location
