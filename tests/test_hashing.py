"""The source identity hash: XXH3-128 by default, sha256 by choice, old sha256 records still read."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import xxhash
from conftest import MNIST_BPK

from syncd.engine import hashing


def digest(name: str, pieces: list[bytes]) -> str:
    hasher = hashing.new_hasher(name)
    for piece in pieces:
        hasher.update(piece)
    return hasher.hexdigest()


def test_the_default_is_the_plain_xxh3_128_of_the_file_and_sha256_is_sha256() -> None:
    data = MNIST_BPK.read_bytes()
    assert hashing.DEFAULT_HASH == hashing.XXH3_128
    assert digest(hashing.DEFAULT_HASH, [data]) == xxhash.xxh3_128_hexdigest(data)  # what `xxhsum -H2` prints
    assert digest(hashing.SHA256, [data]) == hashlib.sha256(data).hexdigest()


def test_streaming_in_uneven_pieces_gives_the_whole_file_digest() -> None:
    data = bytes(range(256)) * 4099
    cuts = [0, 1, 7, 4096, 4097, 70000, len(data)]
    pieces = [data[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    assert b"".join(pieces) == data
    for name in hashing.HASH_CHOICES:
        assert digest(name, pieces) == digest(name, [data])


def test_placeholders_are_exactly_as_long_as_the_digest() -> None:
    for name in hashing.HASH_CHOICES:
        digest_of_x = digest(name, [b"x"])
        assert len(hashing.placeholder(name)) == len(digest_of_x) == hashing.HEX_LENGTH[name]


def test_recorded_hash_reads_new_and_old_outputs() -> None:
    new = {"syncd.source_xxh3_128": xxhash.xxh3_128_hexdigest(b"checkpoint bytes")}
    old = {"syncd.source_sha256": hashlib.sha256(b"checkpoint bytes").hexdigest()}
    assert hashing.recorded_source_hash(new) == hashing.RecordedHash("xxh3_128", new["syncd.source_xxh3_128"])
    assert hashing.recorded_source_hash(old) == hashing.RecordedHash("sha256", old["syncd.source_sha256"])
    assert hashing.recorded_source_hash({"format": "pt"}) is None


def test_an_unknown_hash_is_refused() -> None:
    with pytest.raises(ValueError, match="choose one of xxh3_128, sha256"):
        hashing.new_hasher("md5")


def test_an_output_names_its_source_by_either_recorded_hash(tmp_path: Path) -> None:
    from syncd.engine.convert import ConvertRequest, convert, source_digest
    from syncd.formats import open_checkpoint

    def carries(output: Path) -> bool:  # the recorded hash is the source's, as it is now
        with open_checkpoint(output) as reader:
            recorded = hashing.recorded_source_hash(reader.header.metadata)
        assert recorded is not None
        return recorded.hexdigest == source_digest(source, tmp_path, recorded.name)

    source = tmp_path / MNIST_BPK.name
    source.write_bytes(MNIST_BPK.read_bytes())
    new, old = tmp_path / "new.safetensors", tmp_path / "old.safetensors"
    convert(ConvertRequest(source=source, dest=new))
    convert(ConvertRequest(source=source, dest=old, hash_name="sha256"))  # as versions before XXH3 wrote them
    assert carries(new) and carries(old)
    data = bytearray(source.read_bytes())  # the same name and size, other content: neither output belongs to it
    data[-1] ^= 0x01
    source.write_bytes(bytes(data))
    assert not carries(new) and not carries(old)
