"""Fuzzing both readers and the whole `syncd convert` path.

Every input -- a structured file with hostile values (fuzz_gen.burnpack_files / safetensors_files), a real
file with byte-level edits (fuzz_gen.mutations) or with edits of its decoded header (fuzz_gen.tree_mutations,
often inside the `syncd.*` JSON that conversions carry) -- must end in success or a one-line SyncdError within
fuzz_gen.TIME_LIMIT (2 s) and fuzz_gen.MEMORY_LIMIT (256 MiB of address space beyond the process's own), never
another exception, a hang or a crash; a failed conversion publishes nothing and leaves no scratch file.

* Reader level, in-process: `open_checkpoint`, every tensor read, `inspect`'s description. SYNCD_FUZZ_EXAMPLES
  (default 2000) structured and as many mutated inputs per reader. Each input runs under fuzz_gen.budget:
  SIGALRM after 2 s, RLIMIT_AS = current VmSize + 256 MiB (so an allocation the input provokes raises
  MemoryError, which must not escape as such).
* The convert path, in-process through `syncd.engine.convert.convert` into a temp dir, under the same budget: half
  that count per format, structured and mutated each, over several layouts and both targets. Success must
  leave an output that re-reads; a SyncdError must leave no output and no `.*.syncd-*.tmp`.
* The real CLI, `syncd convert`, in a subprocess (SYNCD_FUZZ_CLI_EXAMPLES, default 80, over both formats)
  under RLIMIT_AS = baseline + 256 MiB, where the baseline is the VmPeak of a child that has imported all
  `convert` uses (measured once per session; ~110 MiB with numpy, which is why RLIMIT_AS is not simply 256 MiB),
  and a timeout of 2 s plus twice the measured import time; exit status in {0,1,2,3}, exactly one stderr line
  on failure, no traceback, nothing published on failure.
* tests/data/regressions/: every input that ever failed, replayed through all three (test_corpus_replay).

CI runs are derandomized (the same inputs every run, ~1.5 min on 2 cores). For a longer pre-release run with
fresh inputs: `python tests/fuzz_long.py` (SYNCD_FUZZ_EXAMPLES=100000 SYNCD_FUZZ_RANDOM=1, failures saved
to tests/data/regressions/incoming/).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fuzz_gen
import pytest
from fuzz_gen import (
    CORPUS_DIR,
    GENTLE,
    burnpack_files,
    check_cli,
    check_convert,
    check_reader,
    mutations,
    pytorch_files,
    pytorch_mutations,
    safetensors_files,
    tree_mutations,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("SYNCD_FUZZ_EXAMPLES", "2000"))
CONVERT_EXAMPLES = max(50, EXAMPLES // 2)
CLI_EXAMPLES = int(os.environ.get("SYNCD_FUZZ_CLI_EXAMPLES", "80"))
RANDOM = bool(os.environ.get("SYNCD_FUZZ_RANDOM"))  # fresh inputs each run instead of CI's fixed ones

FORMATS = {"burnpack": ".bpk", "safetensors": ".safetensors"}


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=not RANDOM,
        database=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )


def report(name: str, counts: Counter, started: float) -> None:
    total = sum(counts.values())
    summary = ", ".join(f"{k} {v}" for k, v in counts.most_common())
    print(f"\n[fuzz] {name}: {total} inputs in {time.monotonic() - started:.1f}s ({summary})")


# ------------------------------------------------------------------------------------------------ readers


def fuzz(title: str, examples: int, drawn: st.SearchStrategy[Any], check: Callable[[Any], str]) -> Counter:
    """`check` `examples` draws of `drawn` (hypothesis shrinks the one that fails); each outcome counted and
    reported under `title`."""
    counts: Counter = Counter()
    started = time.monotonic()

    @fuzz_settings(examples)
    @given(value=drawn)
    def run(value: Any) -> None:
        counts[check(value)] += 1

    run()
    report(title, counts, started)
    return counts


def _files(kind: str, levels: list[int] | None = None) -> st.SearchStrategy[bytes]:
    """Structured files of a format, at the hostility `levels` (default: the generator's)."""
    files = burnpack_files if kind == "burnpack" else safetensors_files
    return files() if levels is None else files(levels)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_reader_structured(kind: str, tmp_path: Path) -> None:
    ext = FORMATS[kind]
    counts = fuzz(f"{kind} reader, structured", EXAMPLES, _files(kind), lambda blob: check_reader(blob, ext, tmp_path))
    assert sum(counts.values()) >= EXAMPLES
    assert counts["ok"] > EXAMPLES // 20, "the generator should produce some valid files"


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_reader_mutated(kind: str, tmp_path: Path) -> None:
    ext, pool = FORMATS[kind], f"{kind}+large"
    cases = st.one_of(mutations(pool), tree_mutations(pool))
    counts = fuzz(f"{kind} reader, mutated", EXAMPLES, cases, lambda case: check_reader(case[1], ext, tmp_path))
    assert sum(counts.values()) >= EXAMPLES


# ------------------------------------------------------------------------------------------------ convert

# (output format, layout): None the other format, "same" the source's
CONVERT_CHOICES: list[tuple[str | None, str]] = [
    *((None, layout) for layout in ("auto", "keep", "pytorch", "burn")),
    *(("same", layout) for layout in ("keep", "auto")),
]
CONVERT_OPTIONS = st.sampled_from([(None, "auto"), *CONVERT_CHOICES])  # the default drawn twice as often


def _options(kind: str, option: tuple[str | None, str]) -> tuple[str | None, str]:
    to_format, layout = option
    return (kind if to_format == "same" else None), layout


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_convert_structured(kind: str, tmp_path: Path) -> None:
    ext = FORMATS[kind]
    drawn = st.tuples(_files(kind, GENTLE), CONVERT_OPTIONS)
    counts = fuzz(
        f"{kind} convert, structured",
        CONVERT_EXAMPLES,
        drawn,
        lambda d: check_convert(d[0], ext, tmp_path, *_options(kind, d[1])),
    )
    assert sum(counts.values()) >= CONVERT_EXAMPLES


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_convert_mutated(kind: str, tmp_path: Path) -> None:
    ext = FORMATS[kind]
    cases = st.one_of(tree_mutations(kind), tree_mutations(kind), mutations(kind))
    counts = fuzz(
        f"{kind} convert, mutated",
        CONVERT_EXAMPLES,
        st.tuples(cases, CONVERT_OPTIONS),
        lambda d: check_convert(d[0][1], ext, tmp_path, *_options(kind, d[1])),
    )
    assert sum(counts.values()) >= CONVERT_EXAMPLES
    assert counts["ok"] > 0, "some mutated files should still convert"


# ------------------------------------------------------------------------------------------------ CLI


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_cli_subprocess(kind: str, tmp_path: Path) -> None:
    ext = FORMATS[kind]
    generated = st.one_of(
        mutations(kind).map(lambda case: case[1]), tree_mutations(kind).map(lambda case: case[1]), _files(kind)
    )
    fuzz(f"{kind} CLI", CLI_EXAMPLES // 2, generated, lambda blob: f"exit {check_cli(blob, ext, tmp_path)}")


# ------------------------------------------------------------------------------------------------ PyTorch

# PyTorch's own checkpoints are read, never written: converted to .bpk, or to .safetensors
PT_OPTIONS = st.sampled_from([(None, "auto"), (None, "keep"), (None, "pytorch"), ("safetensors", "keep")])


@pytest.mark.slow
def test_pytorch_reader_structured(tmp_path: Path) -> None:
    counts = fuzz("pytorch reader, structured", EXAMPLES, pytorch_files(), lambda b: check_reader(b, ".pt", tmp_path))
    assert sum(counts.values()) >= EXAMPLES
    assert counts["ok"] > EXAMPLES // 20, "the generator should produce some valid files"


@pytest.mark.slow
def test_pytorch_reader_mutated(tmp_path: Path) -> None:
    cases = pytorch_mutations()
    counts = fuzz("pytorch reader, mutated", EXAMPLES, cases, lambda case: check_reader(case[1], ".pt", tmp_path))
    assert sum(counts.values()) >= EXAMPLES


@pytest.mark.slow
def test_pytorch_convert(tmp_path: Path) -> None:
    blobs = st.one_of(pytorch_files(GENTLE), pytorch_mutations().map(lambda c: c[1]))
    counts = fuzz(
        "pytorch convert",
        CONVERT_EXAMPLES,
        st.tuples(blobs, PT_OPTIONS),
        lambda d: check_convert(d[0], ".pt", tmp_path, *d[1]),
    )
    assert sum(counts.values()) >= CONVERT_EXAMPLES
    assert counts["ok"] > 0, "some files should convert"


@pytest.mark.slow
def test_pytorch_cli_subprocess(tmp_path: Path) -> None:
    blobs = st.one_of(pytorch_files(), pytorch_mutations().map(lambda c: c[1]))
    fuzz("pytorch CLI", CLI_EXAMPLES // 2, blobs, lambda blob: f"exit {check_cli(blob, '.pt', tmp_path)}")


# ------------------------------------------------------------------------------------------------ corpus

CORPUS = sorted(p for p in CORPUS_DIR.glob("*") if p.suffix in (".bpk", ".safetensors"))


def test_corpus_is_listed() -> None:
    """Each saved input has its one-line note in tests/data/regressions/README.md."""
    readme = (CORPUS_DIR / "README.md").read_text()
    assert [p.name for p in CORPUS if p.name not in readme] == []


@pytest.mark.slow
@pytest.mark.parametrize("path", CORPUS, ids=[p.name for p in CORPUS])
def test_corpus_replay(path: Path, tmp_path: Path) -> None:
    blob = path.read_bytes()
    ext = path.suffix
    kind = "burnpack" if ext == ".bpk" else "safetensors"
    check_reader(blob, ext, tmp_path)
    for option in CONVERT_CHOICES:
        check_convert(blob, ext, tmp_path, *_options(kind, option))
    assert check_cli(blob, ext, tmp_path) in (0, 1, 2, 3)


def _bpk(meta: bytes) -> bytes:
    return struct.pack("<IHI", fuzz_gen.MAGIC, 1, len(meta)) + meta


def _st(text: bytes) -> bytes:
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


MIB = 1 << 20


def _cbor_extra(head: bytes, size: int, item: bytes) -> bytes:
    """A burnpack header {"tensors": {}, "extra": <head claiming `size` items> <item>*size}."""
    return _bpk(b"\xa2\x67tensors\xa0\x65extra" + head + size.to_bytes(4, "big") + item * size)


# Headers far below both formats' size limits (100 MB) that decode into millions of Python objects. (At the
# limits themselves the readers need a few hundred MB: the raw header, its text and its decoded form.)
LARGE_HEADERS = {
    "bpk-empty-arrays": lambda: _cbor_extra(b"\x9a", 2 * MIB, b"\x80"),  # ~64 bytes of objects per byte
    "bpk-small-ints": lambda: _cbor_extra(b"\x9a", 2 * MIB, b"\x00"),
    "bpk-long-text": lambda: _cbor_extra(b"\x7a", 8 * MIB, b"a"),
    "st-empty-arrays": lambda: _st(b'{"a":[' + b"[]," * (2 * MIB) + b"[]]}"),  # ~20 bytes of objects per byte
    "st-small-ints": lambda: _st(b'{"a":[' + b"0," * (4 * MIB) + b"0]}"),
    "st-long-text": lambda: _st(b'{"__metadata__":{"a":"' + b"a" * (8 * MIB) + b'"}}'),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LARGE_HEADERS))
def test_large_headers_within_the_limits(name: str, tmp_path: Path) -> None:
    """Still a SyncdError (or success) within the time and memory budget, never a MemoryError."""
    blob = LARGE_HEADERS[name]()
    ext = ".bpk" if name.startswith("bpk") else ".safetensors"
    check_reader(blob, ext, tmp_path)
    assert check_cli(blob, ext, tmp_path) in (0, 1)


def test_header_too_big_to_decode_is_a_format_error(tmp_path: Path) -> None:
    """Regression (too big for tests/data/regressions/): json.loads' MemoryError escaped the safetensors reader. Here
    6 MiB of `[],` under a 64 MiB budget; in the fuzz run it was a 16 MiB header under 256 MiB."""
    blob = LARGE_HEADERS["st-empty-arrays"]()
    assert check_reader(blob, ".safetensors", tmp_path, memory=64 * MIB) == "FormatError"


@pytest.mark.slow
def test_cbor_amplification_is_bounded(tmp_path: Path) -> None:
    """An 8 MiB burnpack header of empty arrays (Burn allows 100 MiB) read with no address-space limit: the
    reader's peak RSS grows by less than MEMORY_LIMIT (decoding it would take ~570 MB: it is priced first and
    refused)."""
    path = tmp_path / "amplify.bpk"
    path.write_bytes(_cbor_extra(b"\x9a", 8 * MIB, b"\x80"))
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across exec (pytest may be large)
    code = (
        "import sys; from syncd.formats import open_checkpoint\n"
        "def hwm():\n"
        "    return [int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmHWM')][0]\n"
        "before = hwm()\n"
        "try:\n    open_checkpoint(sys.argv[1]).close()\nexcept Exception:\n    pass\n"
        "print((hwm() - before) * 1024)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60, cwd=fuzz_gen.REPO
    )
    assert int(out.stdout) < fuzz_gen.MEMORY_LIMIT, out.stdout + out.stderr


def test_budget_catches_a_hang_and_an_allocation() -> None:
    """The harness itself: an over-long input and an oversized allocation are both caught."""
    with pytest.raises(fuzz_gen.BudgetExceeded), fuzz_gen.budget(seconds=0.2):
        while True:
            pass
    with pytest.raises(MemoryError), fuzz_gen.budget():
        bytearray(fuzz_gen.MEMORY_LIMIT + (64 << 20))
