"""Sources read in place (goodput/data/sources.py): listing, pieces and streamed documents,
on real files the tests write and on the real S3 server of the test session."""

from __future__ import annotations

import builtins
import gzip
import io
import logging
import json
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.config import StorageConfig
from core.errors import DataError
from goodput.data import sources
from goodput.data.sources import (Piece, SourceFile, content_fingerprint, fingerprint, list_hub,
                                  list_source, read_documents, split_into_pieces)

# Multi-byte characters (2, 3 and 4 bytes in UTF-8), so byte cuts land inside them too.
DOCS = [f"doc {i}: {'é' * (i % 3)}{'€' * (i % 5)}{'🦜' * (i % 2)} " + "word " * (i % 17) for i in range(300)]


def jsonl_bytes(docs: list[str], trailing_newline: bool = True) -> bytes:
    lines = []
    for i, doc in enumerate(docs):
        lines.append(json.dumps({"id": i, "text": doc}, ensure_ascii=False))
        if i % 7 == 3:
            lines.append("   ")  # blank lines are no records
    return ("\n".join(lines) + ("\n" if trailing_newline else "")).encode()


def zstd(data: bytes) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as stream:
        stream.write(data)
    return sink.getvalue().to_pybytes()


def compress(data: bytes, compression: str) -> bytes:
    return {"": lambda d: d, "gzip": gzip.compress, "zstd": zstd}[compression](data)


def file_bytes(kind: str, docs: list[str], compression: str = "") -> bytes:
    """The bytes of a file of `docs` in format `kind` (jsonl, json array, txt, parquet)."""
    if kind == "jsonl":
        data = jsonl_bytes(docs)
    elif kind == "json":
        data = json.dumps([{"text": d} for d in docs], ensure_ascii=False, indent=1).encode()
    elif kind == "txt":
        data = "".join(d + ("\r\n" if i % 2 else "\n") for i, d in enumerate(docs)).encode()
    else:
        sink = io.BytesIO()
        pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), sink, row_group_size=40)
        return sink.getvalue()
    return compress(data, compression)


SUFFIX = {"": "", "gzip": ".gz", "zstd": ".zst"}


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def read_all(pieces, **kwargs) -> list[str]:
    docs = []
    for piece in pieces:
        for batch in read_documents(piece, **kwargs):
            docs += batch
    return docs


def local_file(path: Path, fmt="json", compression="") -> SourceFile:
    return SourceFile(uri=str(path), size=path.stat().st_size, version="0", format=fmt, compression=compression)


# -- listing ---------------------------------------------------------------------------------

def test_a_directory_lists_its_files_of_known_formats_sorted_without_reading_them(tmp_path, monkeypatch):
    root = tmp_path / "corpus"
    write(root / "b.jsonl", b'{"text": "b"}\n')
    write(root / "sub" / "a.jsonl.zst", zstd(b'{"text": "a"}\n'))
    write(root / "c.txt.gz", gzip.compress(b"c\n"))
    write(root / "d.parquet", file_bytes("parquet", ["d"]))
    write(root / "e.JSON.ZSTD", zstd(b"[]"))
    write(root / ".hidden.jsonl", b"{}\n")
    write(root / ".cache" / "x.jsonl", b"{}\n")
    write(root / "notes.md", b"# not a corpus\n")

    def no_reading(*args, **kwargs):
        raise AssertionError(f"listing opened {args[0]}")

    monkeypatch.setattr(builtins, "open", no_reading)
    monkeypatch.setattr(io, "open", no_reading)
    files = list_source(str(root))
    monkeypatch.undo()

    assert [Path(f.uri).relative_to(root).as_posix() for f in files] == [
        "b.jsonl", "c.txt.gz", "d.parquet", "e.JSON.ZSTD", "sub/a.jsonl.zst"]
    assert [(f.format, f.compression) for f in files] == [
        ("json", ""), ("text", "gzip"), ("parquet", ""), ("json", "zstd"), ("json", "zstd")]
    for f in files:
        stat = os.stat(f.uri)
        assert (f.size, f.version) == (stat.st_size, str(stat.st_mtime_ns))


def test_globs_and_comma_lists_combine_and_a_touch_changes_the_version(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("x/1.jsonl", "x/deep/2.jsonl.gz", "x/3.txt", "y/4.txt"):
        write(tmp_path / name, compress(b'{"text": "t"}\n', "gzip" if name.endswith(".gz") else ""))
    recursive = list_source("x/**/*.jsonl*")
    assert [Path(f.uri).name for f in recursive] == ["1.jsonl", "2.jsonl.gz"]
    both = list_source("x/3.txt, y , x/*.jsonl")
    assert [Path(f.uri).name for f in both] == ["1.jsonl", "3.txt", "4.txt"]
    assert fingerprint(both)[0] == [str(tmp_path / "x/1.jsonl"), 14, both[0].version, "json", ""]

    before = list_source("x/3.txt")[0]
    os.utime(tmp_path / "x/3.txt", ns=(1, int(before.version) + 10**9))
    assert list_source("x/3.txt")[0].version != before.version
    assert list_source("x/3.txt", fmt="json")[0].format == "json"  # data.format wins over the name


@pytest.mark.parametrize(("source", "message"), [
    ("missing/*.jsonl", r"no files match 'missing/\*.jsonl'"),
    ("data.csv", "cannot tell the format"),
    ("t.parquet.gz", "parquet compresses inside: decompress it"),
])
def test_listing_errors_name_the_path_and_what_to_do(tmp_path, monkeypatch, source, message):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "data.csv", b"a,b\n")
    write(tmp_path / "t.parquet.gz", b"\0")
    with pytest.raises(DataError, match=message) as error:
        list_source(source)
    assert f"data.source='{source}'" in str(error.value)


@pytest.mark.parametrize("source", [
    "corpus/", "corpus/train/", "./corpus", "../corpus", "~/corpus", "{abs}/corpus",
    "corpus.jsonl", "corpus/part-0.parquet", "notes.txt", "rows.json", "table.csv",
    "shard.arrow", "dump.gz", "dump.zst", "a.jsonl, corpus/"])
def test_a_missing_local_path_is_refused_as_such_not_sent_to_the_hub(tmp_path, monkeypatch, source):
    """README's `data.source=corpus/` with no corpus/ here: refused naming the path, where it
    was looked for and what to do; it was read as a hub dataset id ("Repo id must use
    alphanumeric chars ...")."""
    here = tmp_path / "work"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    write(here / "a.jsonl", b'{"text": "t"}\n')
    source = source.format(abs=tmp_path)
    missing = [p.strip() for p in source.split(",")][-1]
    with pytest.raises(DataError) as error:
        list_source(source)
    message = str(error.value)
    assert f"{missing!r} (data.source={source!r}) does not exist" in message, message
    assert f"looked from {here}" in message and "data.source=builtin" in message, message
    assert "hub" not in message.lower(), message
    if missing.endswith("/"):
        assert "no folder" in message and "create it" in message, message


# -- reading ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("kind", "compression"), [
    (k, c) for k in ("jsonl", "json", "txt") for c in ("", "gzip", "zstd")] + [("parquet", "")])
def test_every_format_reads_back_its_documents(tmp_path, kind, compression):
    docs = DOCS[:50] + ["", "  \t "] + DOCS[50:60]  # empty and whitespace documents are dropped
    name = "corpus.parquet" if kind == "parquet" else f"corpus.{kind}{SUFFIX[compression]}"
    path = write(tmp_path / name, file_bytes(kind, docs, compression))
    [file] = list_source(str(path))
    batches = read_documents(Piece(file=file), batch_bytes=2000)
    assert [doc for batch in batches for doc in batch] == DOCS[:60]
    assert (batches.docs, batches.skipped) == (60, 0) and 0 < batches.bytes_read <= file.size


def test_byte_range_pieces_read_every_line_exactly_once_in_order(tmp_path):
    rng = random.Random(7)
    cases = [("jsonl", jsonl_bytes(DOCS, trailing_newline=False)), ("jsonl", jsonl_bytes(DOCS)),
             ("txt", "\n".join(DOCS).encode())]
    for kind, data in cases:
        path = write(tmp_path / f"f.{kind}", data)
        file = local_file(path, "json" if kind == "jsonl" else "text")
        line_starts = [0] + [i + 1 for i, b in enumerate(data) if b == ord("\n")]
        multibyte = [i for i, b in enumerate(data) if b & 0xC0 == 0x80]  # inside a character
        for _ in range(12):
            cuts = set(rng.sample(range(1, len(data)), 6) + rng.sample(line_starts[1:], 3)
                       + rng.sample(multibyte, 3) + [len(data) - 1])
            bounds = [0, *sorted(cuts), len(data)]
            pieces = [Piece(file=file, start=a, stop=b) for a, b in zip(bounds, bounds[1:])]
            assert read_all(pieces) == DOCS, f"{kind} cut at {bounds}"
        counted = [read_documents(p) for p in pieces]
        for batches in counted:
            list(batches)
        assert sum(b.bytes_read for b in counted) == len(data)  # pieces add up to the file


def test_split_groups_small_files_and_cuts_large_ones(tmp_path):
    small = [write(tmp_path / f"s{i}.jsonl", jsonl_bytes(DOCS[i * 10:i * 10 + 10])) for i in range(6)]
    big = write(tmp_path / "t.jsonl", jsonl_bytes(DOCS))
    packed = write(tmp_path / "u.jsonl.gz", gzip.compress(jsonl_bytes(DOCS)))
    files = list_source(str(tmp_path))
    target = 3 * small[0].stat().st_size
    units = split_into_pieces(files, target)

    assert split_into_pieces(files, target) == units  # deterministic
    assert [len(u) for u in units[:2]] == [3, 3]  # the six small files, three to a unit
    cut = [u[0] for u in units if u[0].file.uri == str(big)]
    assert len(cut) == round(big.stat().st_size / target) > 1 and all(len(u) == 1 for u in units[2:])
    assert cut[0].describe() == f"{big} bytes 0-{cut[0].stop}"
    assert [u[0].describe() for u in units if u[0].file.compression] == [str(packed)]  # not cut
    assert read_all([p for u in units for p in u]) == (DOCS[:60] + DOCS + DOCS)
    assert [len(u) for u in split_into_pieces(files, 10**9, max_files=4)] == [4, 4]


def test_parquet_splits_at_row_groups(tmp_path):
    path = write(tmp_path / "p.parquet", file_bytes("parquet", DOCS))  # 8 row groups of 40 rows
    [file] = list_source(str(path))
    units = split_into_pieces([file], file.size // 6)  # footer and header count in file.size
    pieces = [u[0] for u in units]
    assert len(pieces) >= 3 and pieces[0].start == 0 and pieces[-1].stop == 8
    assert all(a.stop == b.start for a, b in zip(pieces, pieces[1:]))
    assert pieces[1].describe().startswith(f"{path} row groups {pieces[1].start}-")
    assert read_all(pieces) == DOCS


def test_batches_are_bounded_by_batch_bytes(tmp_path):
    docs = [f"{i:05d} " + "x" * 94 for i in range(2000)]  # 100 characters each
    path = write(tmp_path / "many.jsonl", jsonl_bytes(docs))
    batches = read_documents(Piece(file=local_file(path)), batch_bytes=10_000)
    sizes = []
    for batch in batches:
        sizes.append(sum(map(len, batch)))
        assert batches.docs == len(sizes) * 100  # counted as they are handed out
    assert len(sizes) == 20 and max(sizes) < 10_000 + 100


# -- bad input -------------------------------------------------------------------------------

def test_a_malformed_line_is_named_by_file_and_line_or_byte_and_can_be_skipped(tmp_path):
    lines = [b'{"text": "one"}', b'{"text": "two"', b'{"body": "three"}', b'{"text": 4}',
             b'"five"', b'{"text": "s\xffx"}', b'{"text": "seven"}']
    path = write(tmp_path / "bad.jsonl", b"\n".join(lines) + b"\n")
    file = local_file(path)
    with pytest.raises(DataError, match=rf"{path} line 2 is not valid JSON .*data.on_bad_record=skip"):
        read_all([Piece(file=file)])
    with pytest.raises(DataError, match=rf"{path} line at byte 16 is not valid JSON"):
        read_all([Piece(file=file, start=10)])
    skipping = read_documents(Piece(file=file), on_bad_record="skip")
    assert [d for b in skipping for d in b] == ["one", "seven"] and skipping.skipped == 5
    no_field = write(tmp_path / "nofield.jsonl", b"\n".join([lines[0], lines[2]]))
    with pytest.raises(DataError, match="line 2 has no field 'text' .*set data.text_column"):
        read_all([Piece(file=local_file(no_field))])
    with pytest.raises(DataError, match="line 1 holds int in 'text', not text"):
        read_all([Piece(file=local_file(write(tmp_path / "int.jsonl", lines[3])))])


def test_bad_text_and_whole_file_problems(tmp_path):
    text = write(tmp_path / "t.txt", b"good\nbad \xff line\nfine\n")
    with pytest.raises(DataError, match=rf"{text} line 2 is not UTF-8 text"):
        read_all([Piece(file=local_file(text, "text"))])
    assert read_all([Piece(file=local_file(text, "text"))], on_bad_record="skip") == ["good", "fine"]

    data = gzip.compress(jsonl_bytes(DOCS))
    truncated = write(tmp_path / "t.jsonl.gz", data[: len(data) // 2])
    garbage = write(tmp_path / "g.jsonl.zst", b"this is no zstd frame" * 10)
    for path, compression in ((truncated, "gzip"), (garbage, "zstd")):
        with pytest.raises(DataError, match=rf"{path} is not a valid {compression} file"):
            read_all([Piece(file=local_file(path, compression=compression))], on_bad_record="skip")

    empty = write(tmp_path / "empty.jsonl", b"")
    assert read_all([Piece(file=local_file(empty))]) == []
    parquet = write(tmp_path / "p.parquet", file_bytes("parquet", ["a"]))
    with pytest.raises(DataError, match=r"no column 'body'; its columns are \['text', 'n'\]: set data.text_column"):
        read_all([Piece(file=local_file(parquet, "parquet"))], text_column="body")
    with pytest.raises(DataError, match="not a readable parquet file"):
        read_all([Piece(file=local_file(text, "parquet"))])


def test_a_json_array_too_large_to_parse_whole_asks_for_json_lines(tmp_path, monkeypatch):
    path = write(tmp_path / "a.json", file_bytes("json", DOCS))
    monkeypatch.setattr(sources, "MAX_WHOLE_JSON", 1000)
    with pytest.raises(DataError, match="convert it to JSON Lines"):
        read_all([Piece(file=local_file(path))])


def test_storage_errors_stay_os_errors(tmp_path):
    gone = write(tmp_path / "gone.jsonl", b'{"text": "x"}\n')
    file = local_file(gone)
    gone.unlink()
    with pytest.raises(FileNotFoundError, match=f"{gone} vanished after it was listed"):
        read_all([Piece(file=file)])
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(IsADirectoryError):
        read_all([Piece(file=SourceFile(uri=str(tmp_path / "dir.jsonl"), size=1, version="0", format="json"))])


def test_content_fingerprint_follows_the_bytes(tmp_path):
    path = write(tmp_path / "a" / "x.jsonl", b'{"text": "x"}\n')
    copy = write(tmp_path / "b" / "x.jsonl", path.read_bytes())
    first = content_fingerprint(list_source(str(path)))
    assert content_fingerprint(list_source(str(copy))) == first  # names, not places
    write(copy, b'{"text": "y"}\n')
    assert content_fingerprint(list_source(str(copy))) != first


# -- the hub ---------------------------------------------------------------------------------

def test_a_hub_dataset_is_split_by_shard_and_read_exactly_once(tmp_path):
    folder = tmp_path / "dataset"
    for i in range(3):
        write(folder / f"part-{i}.jsonl", jsonl_bytes(DOCS[i * 20:i * 20 + 20]))
    file = list_hub(str(folder))  # a local folder streams like a hub dataset, offline
    assert (file.uri, file.format, file.version, file.n_shards) == (f"hub:{folder}", "hub", "latest", 3)
    units = split_into_pieces([file], 1)
    assert [u[0].describe() for u in units] == [f"hub:{folder} shards {i}-{i + 1}" for i in range(3)]
    assert read_all([u[0] for u in units]) == DOCS[:60]
    with pytest.raises(DataError, match=r"no column 'body'.*set data.text_column"):
        read_all([units[0][0]], text_column="body")


def test_an_unreachable_hub_is_a_data_error(monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here: fail at once, not after retries
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="hub is unreachable from here.*use local files"):
        list_source("someone/nonexistent-dataset-xyz")


# -- S3 --------------------------------------------------------------------------------------

@pytest.fixture
def s3_corpus(s3_server, s3_uri):
    """Objects under a fresh prefix: (source URI, StorageConfig, plain boto3 client, bucket, prefix)."""
    bucket, prefix = s3_uri.removeprefix("s3://").split("/", 1)
    client = s3_server.client()
    objects = {
        "corpus/a.jsonl.zst": zstd(jsonl_bytes(DOCS[:100])),
        "corpus/b.parquet": file_bytes("parquet", DOCS),
        "corpus/sub/c.txt": "\n".join(DOCS).encode(),
        "corpus/.staging/d.jsonl": b'{"text": "hidden"}\n',
        "corpus/_SUCCESS": b"",
        "corpus-old/e.jsonl": b'{"text": "a sibling, not under the folder"}\n',
    }
    for key, body in objects.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=body)
    return f"{s3_uri}/corpus", StorageConfig(uri=s3_uri), client, bucket, prefix


@pytest.mark.s3
def test_s3_prefixes_list_and_read_like_local_files(s3_corpus):
    source, storage, _, bucket, prefix = s3_corpus
    files = list_source(source, storage=storage)
    assert [f.uri.removeprefix(f"s3://{bucket}/{prefix}/") for f in files] == [
        "corpus/a.jsonl.zst", "corpus/b.parquet", "corpus/sub/c.txt"]
    assert all(len(f.version) == 32 and f.size > 0 for f in files)  # the ETags
    assert list_source(f"{source}/sub/c.txt", storage=storage) == files[2:]  # one object

    zst, parquet, text = files
    assert read_all([Piece(file=zst)], storage=storage) == DOCS[:100]
    units = split_into_pieces([parquet, text], parquet.size // 3, storage=storage)  # reads a footer
    assert {u[0].file.format for u in units} == {"parquet", "text"}
    assert [u[0].start > 0 for u in units if u[0].file.format == "text"].count(True) >= 2  # byte ranges
    assert read_all([u[0] for u in units], storage=storage) == DOCS + DOCS
    assert content_fingerprint(files, storage) != content_fingerprint(files[:2], storage)


@pytest.mark.s3
def test_an_s3_object_deleted_or_replaced_after_listing_is_reported(s3_corpus):
    source, storage, client, bucket, prefix = s3_corpus
    zst, _, text = list_source(source, storage=storage)
    client.delete_object(Bucket=bucket, Key=f"{prefix}/corpus/a.jsonl.zst")
    with pytest.raises(FileNotFoundError, match=f"{zst.uri} vanished after it was listed"):
        read_all([Piece(file=zst)], storage=storage)
    client.put_object(Bucket=bucket, Key=f"{prefix}/corpus/sub/c.txt", Body=b"new text\n")
    with pytest.raises(DataError, match=f"{text.uri} changed after it was listed"):
        read_all([Piece(file=text, start=5, stop=50)], storage=storage)


@pytest.mark.s3
def test_an_empty_s3_prefix_is_a_data_error(s3_uri):
    with pytest.raises(DataError, match=f"no objects of a known format .* under {s3_uri}/nothing"):
        list_source(f"{s3_uri}/nothing", storage=StorageConfig(uri=s3_uri))


@pytest.mark.s3
def test_an_s3_glob_lists_the_matching_objects(s3_corpus):
    source, storage, _, bucket, prefix = s3_corpus
    base = f"s3://{bucket}/{prefix}/"

    def listed(pattern):
        return [f.uri.removeprefix(base) for f in list_source(base + pattern, storage=storage)]

    assert listed("corpus/*.zst") == ["corpus/a.jsonl.zst"]
    assert listed("corpus/**/*.txt") == ["corpus/sub/c.txt"]
    assert listed("corpus*/*.jsonl") == ["corpus-old/e.jsonl"]  # not the hidden .staging/d.jsonl
    assert listed("corpus/s?b") == ["corpus/sub/c.txt"]  # a matched folder: its files
    assert [f.uri.removeprefix(base) for f in list_source(
        f"{base}corpus/*.parquet,{base}corpus/*.zst", storage=storage)] == ["corpus/a.jsonl.zst", "corpus/b.parquet"]
    with pytest.raises(DataError, match=r"no objects of a known format .* match .*corpus/\*\.gz.*fix the glob"):
        list_source(base + "corpus/*.gz", storage=storage)


def test_s3_globs_name_what_local_globs_name(tmp_path):
    keys = ["c/a.jsonl.zst", "c/b.jsonl.gz", "c/sub/c.txt", "c/sub/deep/d.jsonl", "c/.hidden/e.jsonl",
            "c/.f.jsonl", "c2/g.jsonl", "c/sub2/h.parquet", "x.jsonl", "c/[x].txt", "c/sub/notes.md"]
    for key in keys:
        write(tmp_path / key, b'{"text": "x"}\n')

    class Store:  # what list_objects of a bucket holding `keys` answers
        def list_objects(self, prefix):
            return [(k, 1, "etag") for k in sorted(keys) if k.startswith(prefix)]

    for pattern in ["c/*.zst", "c*/*.jsonl", "c/**/*.jsonl", "**/*.jsonl", "c/**", "c/sub*",
                    "c/s?b/*.txt", "c/[ab].*", "c/[!a]*.gz", "*.jsonl", "c/**/d.jsonl", "**", "c/.*"]:
        local = {str(p.relative_to(tmp_path)) for p in sources._expand(str(tmp_path / pattern))}
        assert {k for k, _, _ in sources._glob_s3(Store(), pattern)} == local, pattern


@pytest.mark.s3
def test_s3_objects_with_hashes_and_question_marks_in_their_keys_are_read(s3_corpus):
    _, storage, client, bucket, prefix = s3_corpus
    client.put_object(Bucket=bucket, Key=f"{prefix}/odd/part#1.jsonl", Body=jsonl_bytes(DOCS[:5]))
    client.put_object(Bucket=bucket, Key=f"{prefix}/odd/part?2.jsonl", Body=jsonl_bytes(DOCS[5:9]))
    files = list_source(f"s3://{bucket}/{prefix}/odd", storage=storage)
    assert [f.uri.rsplit("/", 1)[1] for f in files] == ["part#1.jsonl", "part?2.jsonl"]
    assert read_all([Piece(file=f) for f in files], storage=storage) == DOCS[:9]


def test_ndjson_files_are_json_lines_not_silently_left_out_of_a_directory(tmp_path):
    # .ndjson is a common name for JSON Lines; a directory listing used to skip such files.
    write(tmp_path / "a.ndjson", jsonl_bytes(DOCS[:3]))
    write(tmp_path / "b.ndjson.gz", gzip.compress(jsonl_bytes(DOCS[3:5])))
    files = list_source(str(tmp_path))
    assert [(Path(f.uri).name, f.format, f.compression) for f in files] == [
        ("a.ndjson", "json", ""), ("b.ndjson.gz", "json", "gzip")]
    assert read_all([Piece(file=f) for f in files]) == DOCS[:5]


def test_a_folders_files_of_no_known_format_are_named_when_left_out(tmp_path, caplog):
    write(tmp_path / "corpus.jsonl", jsonl_bytes(DOCS[:3]))
    write(tmp_path / "more" / "notes.csv", b"text\nhello\n")
    write(tmp_path / "README.md", b"# about this corpus\n")
    write(tmp_path / ".cache" / "x.bin", b"\0")  # hidden: no corpus, no word
    with caplog.at_level(logging.WARNING, logger="goodput.data.sources"):
        files = list_source(str(tmp_path))
    assert [Path(f.uri).name for f in files] == ["corpus.jsonl"]
    warned = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(warned) == 1 and "2 file(s)" in warned[0] and "README.md, more/notes.csv" in warned[0]
    # Named with data.format, such a file is read.
    assert read_all([Piece(file=f) for f in list_source(str(tmp_path / "README.md"), "text")]) == [
        "# about this corpus"]


def test_a_folder_saved_by_datasets_save_to_disk_is_named_with_how_to_convert_it(tmp_path):
    # save_to_disk writes Arrow files beside dataset_info.json and state.json; those JSON files
    # used to be read as JSON Lines, failing on "dataset_info.json line 1 is not valid JSON".
    import datasets

    datasets.Dataset.from_dict({"text": DOCS[:5]}).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:5]})}).save_to_disk(
        str(tmp_path / "saved_dict"))
    for folder, marker in (("saved", "state.json"), ("saved_dict", "dataset_dict.json")):
        with pytest.raises(DataError, match=rf"{tmp_path / folder} holds a dataset saved by datasets' "
                           rf"save_to_disk \({marker}\).*load_from_disk.*to_parquet"):
            list_source(str(tmp_path / folder))


def test_a_folder_without_files_of_a_known_format_says_so_not_that_nothing_matches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "xz" / "a.jsonl.xz", b"\xfd7zXZ\0")
    known = r"'xz' \(data.source='xz'\) holds no files of a known format"
    with pytest.raises(DataError, match=known) as error:
        list_source("xz")
    assert "no files match" not in str(error.value)


@pytest.mark.parametrize("kind", ["jsonl", "json", "txt"])
def test_a_utf8_byte_order_mark_is_no_part_of_the_first_record(tmp_path, kind):
    # Windows tools (Notepad, PowerShell's Out-File) start UTF-8 files with a BOM; JSON parsers
    # refuse it, and in text it would become the first document's first character.
    path = write(tmp_path / f"bom.{kind}", b"\xef\xbb\xbf" + file_bytes(kind, DOCS[:20]))
    [file] = list_source(str(path))
    assert read_all([Piece(file=file)]) == DOCS[:20]
    middle = path.stat().st_size // 2  # pieces after the first still read each line once
    assert read_all([Piece(file=file, stop=middle), Piece(file=file, start=middle)]) == DOCS[:20]


CARD = b"---\nlicense: mit\nlanguage: [en]\n---\n# My corpus\n\nA dataset card.\n"


def test_a_hub_style_folder_gives_its_train_split_and_names_what_it_left_out(tmp_path, caplog):
    # A folder as the hub (or huggingface-cli download) lays it out: README.md, a dataset card,
    # and data/<split>-NNNNN-of-NNNNN.parquet. Its test split used to be trained on, and the
    # card named with a hint to rename it.
    write(tmp_path / "README.md", CARD)
    write(tmp_path / "data" / "train-00000-of-00002.parquet", file_bytes("parquet", DOCS[:10]))
    write(tmp_path / "data" / "train-00001-of-00002.parquet", file_bytes("parquet", DOCS[10:20]))
    write(tmp_path / "data" / "test-00000-of-00001.parquet", file_bytes("parquet", DOCS[20:30]))
    with caplog.at_level(logging.INFO, logger="goodput.data.sources"):
        files = list_source(str(tmp_path))
    assert [Path(f.uri).name for f in files] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    assert read_all([Piece(file=f) for f in files]) == DOCS[:20]
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "reading its train split (2 files)" in said
    assert "left out: split test: 1 file(s), data/test-00000-of-00001.parquet" in said
    assert "README.md" not in said and "rename" not in said
    # data.hub_split chooses another split, as for a hub dataset.
    assert [Path(f.uri).name for f in list_source(str(tmp_path), hub_split="test")] == [
        "test-00000-of-00001.parquet"]
    with pytest.raises(DataError, match=r"splits test, train, none of them 'validation': set "
                                        r"data.hub_split=<one of them>"):
        list_source(str(tmp_path), hub_split="validation")


def test_split_named_files_and_folders_follow_datasets_conventions_in_a_hub_dataset(tmp_path, caplog):
    """With a dataset card (or the hub's -of- shard names) a folder is split as
    datasets.load_dataset splits it. Without, it is read whole, as before (its dataset id
    unchanged), and files named like a held-out split are named in a warning."""
    by_file = tmp_path / "by_file"
    write(by_file / "train.jsonl", jsonl_bytes(DOCS[:5]))
    write(by_file / "valid.jsonl", jsonl_bytes(DOCS[5:7]))
    write(by_file / "dev.jsonl", jsonl_bytes(DOCS[7:9]))
    with caplog.at_level(logging.WARNING, logger="goodput.data.sources"):
        assert sorted(read_all([Piece(file=f) for f in list_source(str(by_file))])) == sorted(DOCS[:9])
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "read whole, 2 file(s), dev.jsonl, valid.jsonl included" in said
    write(by_file / "README.md", CARD)  # now a hub dataset
    assert read_all([Piece(file=f) for f in list_source(str(by_file))]) == DOCS[:5]
    by_folder = tmp_path / "by_folder"
    write(by_folder / "README.md", CARD)
    write(by_folder / "train" / "a.jsonl", jsonl_bytes(DOCS[:5]))
    write(by_folder / "train" / "b.txt", "\n".join(DOCS[5:8]).encode())
    write(by_folder / "test" / "a.jsonl", jsonl_bytes(DOCS[8:9]))
    assert read_all([Piece(file=f) for f in list_source(str(by_folder))]) == DOCS[:8]
    # Only a test split: none to train on, said so rather than training on the test set.
    only_test = tmp_path / "only_test"
    write(only_test / "README.md", CARD)
    write(only_test / "test.jsonl", jsonl_bytes(DOCS[:5]))
    with pytest.raises(DataError, match=r"laid out as a Hugging Face dataset .*with the splits test"):
        list_source(str(only_test))


def test_a_users_own_corpus_folder_is_read_whole_whatever_its_names(tmp_path):
    """Names that datasets' patterns would take for splits, in a folder that is no hub
    dataset: every corpus file is read (scripts and notes are no split of it)."""
    corpus = tmp_path / "corpus"
    write(corpus / "part1.jsonl", jsonl_bytes(DOCS[:3]))
    write(corpus / "part2.jsonl", jsonl_bytes(DOCS[3:6]))
    write(corpus / "train_notes.jsonl", jsonl_bytes(DOCS[6:8]))
    write(corpus / "train.py", b"print('hello')\n")
    write(corpus / "scripts" / "dev-setup.md", b"# setup\n")
    write(corpus / "crawl-2023-val.jsonl", jsonl_bytes(DOCS[8:10]))
    assert sorted(read_all([Piece(file=f) for f in list_source(str(corpus))])) == sorted(DOCS[:10])


def test_a_dataset_card_s_configs_choose_the_files(tmp_path, caplog):
    # The card's YAML `configs:` data_files win over file names, as in datasets.load_dataset.
    write(tmp_path / "README.md", b"---\nconfigs:\n- config_name: default\n  data_files:\n"
                                  b"  - split: train\n    path: corpus/*.jsonl\n"
                                  b"  - split: test\n    path: held_out.jsonl\n---\n# card\n")
    write(tmp_path / "corpus" / "part-a.jsonl", jsonl_bytes(DOCS[:5]))
    write(tmp_path / "corpus" / "part-b.jsonl", jsonl_bytes(DOCS[5:9]))
    write(tmp_path / "held_out.jsonl", jsonl_bytes(DOCS[9:12]))
    write(tmp_path / "scratch.jsonl", jsonl_bytes(DOCS[12:13]))  # in no split of the card
    with caplog.at_level(logging.INFO, logger="goodput.data.sources"):
        files = list_source(str(tmp_path))
    assert read_all([Piece(file=f) for f in files]) == DOCS[:9]
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "split test: 1 file(s), held_out.jsonl; in no split: 1 file(s), scratch.jsonl" in said
    with pytest.raises(DataError, match=r"has no config 'other'; its configs are \['default'\]: "
                                        r"set data.hub_config"):
        list_source(str(tmp_path), hub_config="other")


def test_a_folder_without_split_naming_is_read_whole_and_its_card_is_no_file_to_rename(tmp_path, caplog):
    write(tmp_path / "README.md", CARD)
    write(tmp_path / "web" / "part-0.jsonl", jsonl_bytes(DOCS[:5]))
    write(tmp_path / "books.jsonl", jsonl_bytes(DOCS[5:9]))
    with caplog.at_level(logging.INFO, logger="goodput.data.sources"):
        files = list_source(str(tmp_path))
    assert sorted(read_all([Piece(file=f) for f in files])) == sorted(DOCS[:9])
    assert not [r for r in caplog.records if "left out" in r.getMessage() or "laid out" in r.getMessage()]


def test_a_hub_dataset_further_down_among_other_corpora_does_not_split_the_folder(tmp_path):
    """`data.source=corpus/` reads every known file below it. A hub dataset downloaded two
    folders down (corpus/hub/data/train-00000-of-00001.parquet) beside other corpora does
    not make the whole folder a hub dataset, whose train split would leave the rest out."""
    write(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet", file_bytes("parquet", DOCS[:5]))
    write(tmp_path / "web" / "part-0.jsonl", jsonl_bytes(DOCS[5:9]))
    write(tmp_path / "books.jsonl", jsonl_bytes(DOCS[9:12]))
    files = list_source(str(tmp_path))
    assert sorted(read_all([Piece(file=f) for f in files])) == sorted(DOCS[:12])


def test_a_categorical_text_column_is_read_as_its_values(tmp_path):
    """A parquet column of dictionary-encoded strings (pandas' categorical) is text."""
    path = tmp_path / "cat.parquet"
    pq.write_table(pa.table({"text": pa.array(DOCS[:6] * 2).dictionary_encode()}), path)
    assert read_all([Piece(file=local_file(path, "parquet"))]) == DOCS[:6] * 2


def test_the_fix_for_a_saved_dataset_below_the_source_folder_names_the_folder_to_load(tmp_path):
    # load_from_disk('/x/corpus') fails where save_to_disk wrote /x/corpus/hf_saved: the
    # suggested line must work when pasted.
    import datasets

    datasets.Dataset.from_dict({"text": DOCS[:5]}).save_to_disk(str(tmp_path / "corpus" / "hf_saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:5]})}).save_to_disk(
        str(tmp_path / "splits" / "hf_dict"))
    for folder, saved, split in (("corpus", "corpus/hf_saved", ""), ("splits", "splits/hf_dict", "['train']")):
        with pytest.raises(DataError) as refused:
            list_source(str(tmp_path / folder) + "/")
        suggested = f"datasets.load_from_disk('{tmp_path / saved}'){split}.to_parquet('corpus.parquet')"
        assert suggested in str(refused.value)
        loaded = datasets.load_from_disk(str(tmp_path / saved))  # the line as pasted works
        assert (loaded["train"] if split else loaded)["text"] == DOCS[:5]
