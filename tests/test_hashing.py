"""The source identity hash (issue 15): XXH3-128 by default, sha256 by choice, old sha256 records still read."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import xxhash
from conftest import MNIST_BPK

from syncd.engine import hashing


def test_the_default_is_the_plain_xxh3_128_of_the_file_and_sha256_is_sha256() -> None:
    data = MNIST_BPK.read_bytes()
    assert hashing.DEFAULT_HASH == hashing.XXH3_128
    assert hashing.file_digest(MNIST_BPK) == xxhash.xxh3_128_hexdigest(data)  # what `xxhsum -H2` prints
    assert hashing.file_digest(MNIST_BPK, hashing.SHA256) == hashlib.sha256(data).hexdigest()


def test_streaming_in_uneven_pieces_gives_the_whole_file_digest(tmp_path: Path) -> None:
    data = bytes(range(256)) * 4099
    cuts = [0, 1, 7, 4096, 4097, 70000, len(data)]
    pieces = [data[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    assert b"".join(pieces) == data
    for name in hashing.HASH_CHOICES:
        path = tmp_path / "f"
        path.write_bytes(data)
        assert hashing.digest_chunks(name, pieces) == hashing.file_digest(path, name, chunk=4096)


def test_placeholders_are_exactly_as_long_as_the_digest() -> None:
    for name in hashing.HASH_CHOICES:
        digest = hashing.digest_chunks(name, [b"x"])
        assert len(hashing.placeholder(name)) == len(digest) == hashing.HEX_LENGTH[name]


def test_recorded_hash_reads_new_and_old_outputs(tmp_path: Path) -> None:
    path = tmp_path / "src"
    path.write_bytes(b"checkpoint bytes")
    new = {"syncd.source_xxh3_128": xxhash.xxh3_128_hexdigest(b"checkpoint bytes")}
    old = {"syncd.source_sha256": hashlib.sha256(b"checkpoint bytes").hexdigest()}
    assert hashing.recorded_source_hash(new) == hashing.RecordedHash("xxh3_128", new["syncd.source_xxh3_128"])
    assert hashing.recorded_source_hash(old) == hashing.RecordedHash("sha256", old["syncd.source_sha256"])
    assert hashing.recorded_source_hash({"format": "pt"}) is None
    for metadata in (new, old):
        recorded = hashing.recorded_source_hash(metadata)
        assert recorded is not None and recorded.matches_file(path)
    path.write_bytes(b"checkpoint bytes, changed")
    assert not hashing.recorded_source_hash(new).matches_file(path)  # type: ignore[union-attr]
    assert not hashing.recorded_source_hash(old).matches_file(path)  # type: ignore[union-attr]


def test_an_unknown_hash_is_refused() -> None:
    with pytest.raises(ValueError, match="choose one of xxh3_128, sha256"):
        hashing.new_hasher("md5")


def test_the_daemon_knows_its_outputs_by_either_recorded_hash(tmp_path: Path) -> None:
    from syncd.daemon.ownership import carries_source as _carries_source
    from syncd.engine.convert import ConvertRequest, convert

    source = tmp_path / MNIST_BPK.name
    source.write_bytes(MNIST_BPK.read_bytes())
    new, old = tmp_path / "new.safetensors", tmp_path / "old.safetensors"
    convert(ConvertRequest(source=source, dest=new))
    convert(ConvertRequest(source=source, dest=old, hash_name="sha256"))  # as versions before XXH3 wrote them
    assert _carries_source(new, source, tmp_path, tmp_path) and _carries_source(old, source, tmp_path, tmp_path)
    data = bytearray(source.read_bytes())  # the same name and size, other content: neither output belongs to it
    data[-1] ^= 0x01
    source.write_bytes(bytes(data))
    assert not _carries_source(new, source, tmp_path, tmp_path)
    assert not _carries_source(old, source, tmp_path, tmp_path)
