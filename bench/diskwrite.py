"""The disk's own time for a file's bytes: SIZE-OF-SRC bytes written to DST straight to the disk, then fsync.

    python bench/diskwrite.py SRC DST

Writes as many bytes as SRC holds (rounded up to 4 KiB, which O_DIRECT asks for) from one page-aligned buffer,
16 MiB at a time, with O_DIRECT: no page cache, so no copy into it, no page allocation (which this VM's host
faults on, see measure.touch_memory) and no writeback; the fsync flushes the disk's own write cache. SRC is not
read: this is what the disk takes to store that many bytes, a floor under any writer that makes its output
durable before publishing it (`cp` + fsync also copies and goes through the page cache). On a file system
without O_DIRECT the run fails with one line, and the row shows the failure.
"""

from __future__ import annotations

import mmap
import os
import sys

CHUNK = 16 << 20
ALIGN = 4096


def write_direct(nbytes: int, dst: str) -> None:
    buffer = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs the memory to be
    buffer.write(bytes(range(256)) * (CHUNK // 256))  # not zero pages: the bytes a real file would hold
    total = -(-nbytes // ALIGN) * ALIGN
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o644)
    try:
        done = 0
        while done < total:
            n = os.pwrite(fd, memoryview(buffer)[: min(CHUNK, total - done)], done)
            done += n
        os.fsync(fd)
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: diskwrite.py SRC DST", file=sys.stderr)
        return 2
    try:
        write_direct(os.stat(argv[0]).st_size, argv[1])
    except OSError as exc:
        print(f"{argv[1]}: cannot write with O_DIRECT: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
