"""The source identity hash recorded in every output, and the digests syncd checks its own writes with.

Every output records a hash of its source's bytes so a later run (and the daemon) can tell whether an output
still belongs to its source. The default is XXH3-128 (`syncd.source_xxh3_128`): it runs near memory speed
(~25 GB/s in cache on the project machine, against 1.6 GB/s for sha256 with SHA extensions), so it can be fed
from the one read of the source that also feeds the conversion. It is the plain XXH3-128 of the file, the
value `xxhsum -H2 FILE` prints. `--hash sha256` (or `hash: sha256` in the config) records a cryptographic
`syncd.source_sha256` instead, for users who need one. Outputs written before XXH3 was the default carry
`syncd.source_sha256`; both keys are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

XXH3_128 = "xxh3_128"
SHA256 = "sha256"
HASH_CHOICES = (XXH3_128, SHA256)
DEFAULT_HASH = XXH3_128

# metadata key per hash; spelled out here (not derived) so a renamed constant cannot silently change files
SOURCE_HASH_KEYS = {XXH3_128: "syncd.source_xxh3_128", SHA256: "syncd.source_sha256"}
HEX_LENGTH = {XXH3_128: 32, SHA256: 64}


class Hasher(Protocol):
    def update(self, data: Any) -> None: ...
    def hexdigest(self) -> str: ...


def new_hasher(name: str) -> Hasher:
    """A streaming hasher of `name` (one of HASH_CHOICES)."""
    if name == SHA256:
        import hashlib  # here: its OpenSSL bindings take a few ms to load, and only --hash sha256 needs them

        return hashlib.sha256()
    if name == XXH3_128:
        import xxhash  # imported here: `syncd inspect` and the daemon's config checks never need it

        return xxhash.xxh3_128()
    raise ValueError(f"unknown hash {name!r}; choose one of {', '.join(HASH_CHOICES)}")


def placeholder(name: str) -> str:
    """Text exactly as long as a hex digest of `name`: written first, replaced in place once the hash is known."""
    return f"{name}-of-the-source-pending".ljust(HEX_LENGTH[name], "0")


@dataclass(frozen=True)
class RecordedHash:
    """The source hash an output says it was made from."""

    name: str
    hexdigest: str


def recorded_source_hash(metadata: dict[str, str]) -> RecordedHash | None:
    """The source hash recorded in an output's metadata: XXH3-128 if present, else sha256 (older outputs)."""
    for name in HASH_CHOICES:
        value = metadata.get(SOURCE_HASH_KEYS[name])
        if value is not None:
            return RecordedHash(name, value)
    return None


def block_digest(data: Any) -> int:
    """XXH3-64 of one written block: the per-block check of what syncd wrote (not an identity hash)."""
    import xxhash

    return xxhash.xxh3_64_intdigest(data)
