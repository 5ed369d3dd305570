"""Checkpoints that change under syncd's feet: a directory moved out of the tree while its checkpoint converts
(and moved back), a sharded set whose shard is rewritten in place keeping its size and mtime, a set whose index
lists a shard that does not arrive."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import fill_up
from convcheck import read_bpk
from daemonutil import DaemonRun, scratch_files
from safetensors.torch import load_file, save_file

from syncd.daemon.config import Watch
from syncd.daemon.readiness import INCOMPLETE_GRACE_SECONDS
from syncd.daemon.state import StateDB
from syncd.daemon.statuses import Status
from syncd.daemon.sync import Syncer
from syncd.daemon.synclog import SyncLog
from syncd.engine import convert as engine_convert
from syncd.engine.convert import ConvertRequest, convert
from syncd.engine.hashing import DEFAULT_HASH
from syncd.engine.options import StoreOptions
from syncd.errors import SyncdError, VerificationError

pytestmark = pytest.mark.torch


def _state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {"fc.weight": torch.randn(64, 32), "fc.bias": torch.randn(64), "norm.weight": torch.randn(64)}


def _saved_in(directory: Path, seed: int = 0) -> Path:
    """`directory` (made with its parents) holding a trainer's model.safetensors: its path."""
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "model.safetensors"
    save_file(_state(seed), source)
    return source


def _syncer(tmp_path: Path) -> tuple[Syncer, Path]:
    """The daemon's decisions in this process, with their own state and sync log (whose path is returned)."""
    log = tmp_path / "sync.log.jsonl"
    return Syncer(StateDB(tmp_path / "state"), SyncLog(log), settle_seconds=0.0, hash_name=DEFAULT_HASH), log


def test_a_directory_moved_away_mid_conversion_is_retried_not_refused(tmp_path: Path) -> None:
    """The written file is checked through its open descriptor, so moving its directory does not make it
    'not read back'; the source no longer at its path is a transient condition, and once the directory is back
    the same conversion succeeds."""
    tree = tmp_path / "tree"
    exp = tree / "exp"
    source = _saved_in(exp)
    away = tmp_path / "away"
    moved: list[bool] = []

    def move_when_written(done: int, total: int) -> None:
        if done == total and not moved:
            os.rename(exp, away)
            moved.append(True)

    with pytest.raises(SyncdError) as caught:
        convert(ConvertRequest(source=source, within=tree, progress=move_when_written))
    assert moved
    assert not isinstance(caught.value, VerificationError), caught.value
    assert caught.value.kind == "busy" or caught.value.transient, caught.value
    assert sorted(os.listdir(away)) == ["model.safetensors"]  # nothing published, no scratch file left
    os.rename(away, exp)
    result = convert(ConvertRequest(source=source, within=tree))
    assert result.status == "published"
    assert sorted(os.listdir(exp)) == ["model.bpk", "model.safetensors"]


def _rewrite_in_place_keeping_size_and_mtime(shard: Path) -> None:
    """New values in the same tensors (so the same size), written into the same inode, mtime set back: what a
    writer that rewrites in place and restores times (or `cp -p`/`rsync -t` over it) leaves."""
    before = os.stat(shard)
    state = {name: tensor + 1 for name, tensor in load_file(shard).items()}
    scratch = shard.with_name("scratch.bin")
    save_file(state, scratch, metadata={"format": "pt"})
    data = scratch.read_bytes()
    scratch.unlink()
    assert len(data) == before.st_size
    with open(shard, "r+b") as f:
        f.write(data)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(shard)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


@pytest.mark.daemon
def test_a_shard_rewritten_in_place_with_the_same_size_and_mtime_updates_the_set(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    from hfsets import save_llama

    run = make_daemon()
    runs = run.watch_dir("runs")
    index = save_llama(runs / "llama", sharded=True)
    run.start()
    run.wait_for("converted", [index])
    _rewrite_in_place_keeping_size_and_mtime(runs / "llama" / "model-00002-of-00003.safetensors")
    run.wait_for("updated", [index], timeout=30)
    code, _ = run.stop()
    assert code == 0, run.stderr()
    reference = tmp_path / "reference.bpk"
    convert(ConvertRequest(source=index, dest=reference))
    written, expected = (runs / "llama" / "model.bpk").read_bytes(), reference.read_bytes()
    assert len(written) == len(expected)
    assert written == expected  # the .bpk holds the new values (the source hash recorded is the same too)
    assert scratch_files(runs) == []


def _set_missing_a_shard(runs: Path, age: float = 0.0) -> tuple[Path, Path]:
    """A save_pretrained set with its second shard taken away (kept aside, to arrive later); with `age`, every
    file's times set that many seconds back."""
    from hfsets import save_llama

    index = save_llama(runs / "llama", sharded=True)
    shard = index.parent / "model-00002-of-00003.safetensors"
    aside = runs.parent / "aside.safetensors"
    os.rename(shard, aside)
    if age:
        for path in [*index.parent.iterdir(), aside]:  # (the one set aside too: it is of the same save)
            past = os.stat(path).st_mtime - age
            os.utime(path, (past, past))
    return index, aside


@pytest.mark.daemon
def test_a_shard_that_is_not_there_yet_is_waited_for_with_one_line(make_daemon: Callable[..., DaemonRun]) -> None:
    run = make_daemon()
    runs = run.watch_dir("runs")
    index, aside = _set_missing_a_shard(runs)
    run.start()
    run.wait_for("warning", [index])
    time.sleep(4)  # on the old code: a retry three times a second, each a journal line
    (waiting,) = [r for r in run.records() if r.get("source") == str(index)]
    assert waiting["status"] == "warning"
    assert "waiting for model-00002-of-00003.safetensors" in waiting["reason"]
    assert len([line for line in run.stderr().splitlines() if "llama" in line]) <= 2, run.stderr()
    os.rename(aside, index.parent / "model-00002-of-00003.safetensors")  # it arrives: the set converts at once
    run.wait_for("converted", [index], timeout=30)
    code, _ = run.stop()
    assert code == 0, run.stderr()


@pytest.mark.daemon
def test_a_shard_that_never_arrives_is_refused_once_naming_it(make_daemon: Callable[..., DaemonRun]) -> None:
    run = make_daemon()
    runs = run.watch_dir("runs")
    index, aside = _set_missing_a_shard(runs, age=120)  # quiet for longer than a truncated file may be
    run.start()
    run.wait_for("refused", [index], timeout=30)
    time.sleep(3)
    records = [r for r in run.records() if r.get("source") == str(index)]
    assert [r["status"] for r in records] == ["refused"]
    assert "lists model-00002-of-00003.safetensors, not there after 60 s" in records[0]["error"]
    os.rename(aside, index.parent / "model-00002-of-00003.safetensors")  # late after all: a new version of the set
    run.wait_for("converted", [index], timeout=30)
    code, _ = run.stop()
    assert code == 0, run.stderr()


def _large_refused_index(path: Path, size: int) -> None:
    """A valid JSON index of about `size` bytes, of long tensor names, whose last entry names a shard outside
    its directory: read and decoded whole before it is refused."""
    names = []
    total = 0
    while total < size:
        name = f"blocks.{len(names)}." + "x" * 200
        names.append(name)
        total += len(name) + 40
    weight_map = dict.fromkeys(names, "model-00001-of-00002.safetensors")
    weight_map["last"] = "../elsewhere.safetensors"
    path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def _bytes_read(pid: int) -> int:
    with open(f"/proc/{pid}/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


@pytest.mark.daemon
def test_an_index_is_parsed_once_per_version_not_on_every_event_beside_it(
    make_daemon: Callable[..., DaemonRun],
) -> None:
    run = make_daemon()
    runs = run.watch_dir("runs")
    index = runs / "big.safetensors.index.json"
    _large_refused_index(index, 30 << 20)
    run.start()
    files = []
    for k in range(20):  # each save an event beside the index
        files.append(runs / f"m{k}.safetensors")
        save_file(_state(k), files[-1])
    run.wait_for("converted", files, timeout=120)
    run.wait_for("refused", [index])
    assert run.proc is not None
    read = _bytes_read(run.proc.pid)
    code, _ = run.stop()
    assert code == 0, run.stderr()
    # the index read when it is first asked about and when it is converted (refused), the interpreter's own
    # files besides (93 MiB in all when measured); not once per event (663 MiB before)
    assert read < 5 * index.stat().st_size, f"{read >> 20} MiB read for a {index.stat().st_size >> 20} MiB index"


def test_a_file_saved_again_while_it_is_read_is_looked_at_later_not_refused(tmp_path: Path) -> None:
    """A training loop saving again over the same name while the daemon reads the previous save (whose close
    it saw): what is read is neither version, and the error says nothing about the file now there. Only that
    version, once looked at, is refused if it is bad. The daemon's decisions run in this process; the save
    comes between the daemon's look at the file and the conversion opening it (its progress seam)."""
    runs = tmp_path / "runs"
    source = _saved_in(runs, seed=1)
    syncer, _ = _syncer(tmp_path)
    watch = Watch(path=runs, direction="safetensors->bpk")

    def saved_again(path: Path) -> None:
        path.write_bytes(b"{not a checkpoint, and not the file the daemon looked at}")
        syncer.progress_for = lambda _path: None

    syncer.progress_for = saved_again
    outcome = syncer.process(watch, source, closed=True)
    assert (outcome.status, outcome.retry_in is not None) == (None, True)
    assert not (tmp_path / "sync.log.jsonl").exists() or "refused" not in (tmp_path / "sync.log.jsonl").read_text()
    assert syncer.process(watch, source, closed=True).status is Status.REFUSED  # the version there now is bad
    assert not source.with_suffix(".bpk").exists()


@pytest.mark.parametrize("when", ["before-reading", "before-writing", "after-writing"])
def test_a_checkpoint_rotated_away_while_it_converts_is_no_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """A trainer keeping its last N checkpoints removes a whole checkpoint directory while syncd converts it
    (HF Trainer's save_total_limit): the output's directory is gone too. Nothing failed that anyone could fix
    or that a retry could do: no `error` line ("will retry", `syncd retry` of a path that no longer exists),
    no failure in the state (`syncd status`' recent failures)."""
    tree = tmp_path / "tree"
    checkpoint = tree / "checkpoint-20"
    source = _saved_in(checkpoint)
    syncer, log = _syncer(tmp_path)

    def rotate() -> None:
        if checkpoint.exists():
            shutil.rmtree(checkpoint)

    def rotated_away_when_written(done: int, total: int) -> None:
        if done == total:
            rotate()

    def progress_for(_path: Path) -> Callable[[int, int], None] | None:
        # asked for as the conversion starts, right after every check the daemon makes before it
        if when == "before-reading":
            rotate()
            return None
        return rotated_away_when_written

    syncer.progress_for = progress_for
    if when == "before-writing":  # the source read and planned, its output's scratch file not made yet
        clear_scratch = engine_convert.remove_stale_scratch_of

        def rotated_first(dest: Path) -> list[Path]:
            rotate()
            return clear_scratch(dest)

        monkeypatch.setattr(engine_convert, "remove_stale_scratch_of", rotated_first)
    outcome = syncer.process(Watch(path=tree, direction="safetensors->bpk"), source, closed=True)
    assert not checkpoint.exists()
    assert (outcome.status, outcome.retry_in) == (None, None)
    assert not log.exists() or log.read_text() == ""
    row = syncer.state.get(source)
    assert row is None or row.error is None


@pytest.mark.parametrize(("on_exists", "status"), [("skip", Status.SKIPPED), ("error", Status.CONFLICT)])
def test_a_destination_that_appears_while_converting_is_decided_by_on_exists(
    tmp_path: Path, on_exists: str, status: Status
) -> None:
    """Another writer's file (another source of the same output: model.pt beside model.safetensors) put at the
    destination while the conversion ran: with on_exists: skip it is skipped, as a file found there before
    would have been (it was a `conflict`, with advice about --overwrite); with error, a conflict. Never
    replaced."""
    tree = tmp_path / "tree"
    source, dest = _saved_in(tree), tree / "model.bpk"
    syncer, log = _syncer(tmp_path)

    def theirs_appears_when_written(done: int, total: int) -> None:
        if done == total and not dest.exists():
            dest.write_bytes(b"another writer's model.bpk")

    syncer.progress_for = lambda _path: theirs_appears_when_written
    watch = Watch(path=tree, direction="safetensors->bpk", on_exists=on_exists)
    assert syncer.process(watch, source, closed=True).status is status
    assert dest.read_bytes() == b"another writer's model.bpk"
    said = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["status"] for r in said] == [status.value]


def test_a_set_saved_again_in_fewer_shards_is_waited_for_quietly(tmp_path: Path) -> None:
    """save_pretrained removes the shards of the set it replaces before writing the new ones and, last, the new
    index: meanwhile the old index lists shards that went. That is a save under way, not shards still to come."""
    from hfsets import save_llama, tiny_llama

    syncer, log = _syncer(tmp_path)
    watch = Watch(path=tmp_path / "runs")
    index = save_llama(watch.path / "llama", sharded=True)
    assert syncer.process(watch, index, closed=True).status is Status.CONVERTED
    (index.parent / "model-00003-of-00003.safetensors").unlink()  # save_pretrained's clean-up, before its writes
    waiting = syncer.process(watch, index, closed=True)
    assert waiting.status is None and waiting.retry_in is not None
    assert [json.loads(line)["status"] for line in log.read_text().splitlines()] == ["converted"]
    tiny_llama(1).save_pretrained(index.parent, max_shard_size="70KB")  # the save done: the new index last
    assert len(set(json.loads(index.read_text())["weight_map"].values())) == 2
    assert syncer.process(watch, index, closed=True).status is Status.UPDATED


def _shards(index: Path) -> list[Path]:
    return sorted(index.parent / name for name in set(json.loads(index.read_text())["weight_map"].values()))


def _aged(path: Path, seconds: float) -> None:
    """The file as last written `seconds` ago (how long a writer has left it)."""
    when = time.time() - seconds
    os.utime(path, (when, when))


def test_a_save_begun_before_the_earlier_one_was_converted_is_waited_for_until_its_index(tmp_path: Path) -> None:
    """The next save_pretrained began (its first shard written) before the daemon converted the one before,
    whose index is still there: converted then, the output was the new shard with the earlier save's others,
    a model no save ever held, logged as a plain `converted`."""
    from hfsets import save_llama

    syncer, log = _syncer(tmp_path)
    watch = Watch(path=tmp_path / "runs")
    index = save_llama(watch.path / "llama", sharded=True, seed=0)
    following = save_llama(tmp_path / "following", sharded=True, seed=1)
    for shard in _shards(index):
        _aged(shard, 301)
    _aged(index, 300)  # written after its shards, as save_pretrained does
    first = _shards(index)[0]
    shutil.copyfile(following.parent / first.name, first)  # the next save's first shard; the others to come
    waiting = syncer.process(watch, index, closed=True)
    assert waiting.status is None and waiting.retry_in is not None
    assert not (index.parent / "model.bpk").exists() and not log.exists()
    for shard in _shards(index)[1:]:
        shutil.copyfile(following.parent / shard.name, shard)
    shutil.copyfile(following, index)  # the index last: the save committed
    assert syncer.process(watch, index, closed=True).status is Status.CONVERTED
    expected = convert(ConvertRequest(source=following, dest=tmp_path / "expected.bpk", within=tmp_path))
    assert read_bpk(index.parent / "model.bpk").tensors == read_bpk(expected.dest).tensors


def _converted_set_and_its_next_save(syncer: Syncer, tmp_path: Path, age: float) -> tuple[Watch, Path, Path]:
    """(the watch, a set saved in it and converted, the index of the next save made elsewhere); the set's files
    as last written `age` seconds ago, its index after its shards."""
    from hfsets import save_llama

    watch = Watch(path=tmp_path / "runs")
    index = save_llama(watch.path / "llama", sharded=True, seed=0)
    for shard in _shards(index):
        _aged(shard, age + 1)
    _aged(index, age)
    assert syncer.process(watch, index, closed=True).status is Status.CONVERTED
    following = save_llama(tmp_path / "following", sharded=True, seed=1)
    return watch, index, following


def test_a_converted_set_whose_shards_change_without_its_index_waits_for_it_however_long(tmp_path: Path) -> None:
    """A set saved again shard by shard, a shard a minute after the one before (a slow link): past a minute of
    quiet it was converted, new shards with old; now the index is waited for, said once, and `touch` on it
    (a shard edited alone) converts the set as it is."""
    syncer, log = _syncer(tmp_path)
    watch, index, following = _converted_set_and_its_next_save(syncer, tmp_path, age=600)
    first = _shards(index)[0]
    shutil.copyfile(following.parent / first.name, first)
    _aged(first, 2 * INCOMPLETE_GRACE_SECONDS)  # the next shard is long in coming
    for _ in range(2):
        waiting = syncer.process(watch, index, closed=True)
        assert waiting.status is None and waiting.retry_in is not None
    said = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["status"] for r in said] == ["converted", "warning"]
    assert "`touch` the index" in said[1]["reason"]
    index.touch()  # the shard was edited alone: the set as it is now, once left so
    waiting = syncer.process(watch, index, closed=True)
    assert waiting.status is None and waiting.retry_in is not None
    _aged(index, INCOMPLETE_GRACE_SECONDS + 1)  # a minute after the touch
    assert syncer.process(watch, index, closed=True).status is Status.UPDATED


def _copied_shard_by_shard(syncer: Syncer, watch: Watch, index: Path, following: Path) -> None:
    """The shards of the set behind `following` copied over `index`'s one by one: waited for after the first,
    converted once all are there, into what `following` converts to."""
    first, *others = _shards(index)
    shutil.copyfile(following.parent / first.name, first)
    waiting = syncer.process(watch, index, closed=True)
    assert waiting.status is None and waiting.retry_in is not None
    for shard in others:
        shutil.copyfile(following.parent / shard.name, shard)
    assert syncer.process(watch, index, closed=True).status is Status.UPDATED
    expected = convert(ConvertRequest(source=following, dest=following.parent / "expected.bpk"))
    assert read_bpk(index.parent / "model.bpk").tensors == read_bpk(expected.dest).tensors


def test_a_converted_set_copied_again_index_first_ends_converted_with_its_new_shards(tmp_path: Path) -> None:
    """The next version copied over a converted set, its index first: the new index beside the old shards is a
    whole set (converted), the first new shard beside old ones is not (waited for), and once every shard is new
    the set is converted again. (Waiting for an index that had already come, it was never converted.)"""
    syncer, log = _syncer(tmp_path)
    watch, index, following = _converted_set_and_its_next_save(syncer, tmp_path, age=300)
    shutil.copyfile(following, index)  # the copy's first file
    _aged(index, 200)
    assert syncer.process(watch, index, closed=True).status is Status.UPDATED  # the old shards: a whole set
    _copied_shard_by_shard(syncer, watch, index, following)
    again = syncer.process(watch, index, closed=True)  # as converted: nothing waited for, nothing said
    assert again.status is None and again.retry_in is None
    assert "warning" not in [json.loads(line)["status"] for line in log.read_text().splitlines()]


def test_the_next_save_of_a_set_copied_in_index_first_is_waited_for_until_whole(tmp_path: Path) -> None:
    """A set copied in index first was converted with every shard newer than its index; the next save's first
    shard then made them all "newer than the index", a whole set: the output mixed two saves."""
    from hfsets import save_llama

    syncer, log = _syncer(tmp_path)
    watch = Watch(path=tmp_path / "runs")
    index = save_llama(watch.path / "llama", sharded=True, seed=0)
    _aged(index, 300)
    for shard in _shards(index):
        _aged(shard, 200)
    assert syncer.process(watch, index, closed=True).status is Status.CONVERTED
    following = save_llama(tmp_path / "following", sharded=True, seed=1)
    _copied_shard_by_shard(syncer, watch, index, following)
    assert [json.loads(line)["status"] for line in log.read_text().splitlines()] == ["converted", "updated"]


@pytest.mark.parametrize("pattern", ["*.index.json", "llama/model.safetensors.index.json"])
def test_a_set_left_out_by_its_index_name_is_not_converted_through_its_shards(tmp_path: Path, pattern: str) -> None:
    """`exclude` naming a set's index left the index out, but a shard's event (the start's scan, a rescan, a
    shard written again) still brought the set through that index, and it was converted."""
    from hfsets import save_llama

    syncer, log = _syncer(tmp_path)
    watch = Watch(path=tmp_path / "runs", exclude=(pattern,))
    index = save_llama(watch.path / "llama", sharded=True)
    for path in [*_shards(index), index]:
        outcome = syncer.process(watch, path, closed=True)
        assert outcome.status is None and outcome.retry_in is None
    assert not (index.parent / "model.bpk").exists() and not log.exists()


def test_a_set_copied_in_index_first_is_converted_once_settled(tmp_path: Path) -> None:
    """Every shard newer than an index never converted: a copy that put the index first, not a save under way.
    Some older and some newer: a download in any order, converted once left a minute."""
    from hfsets import save_llama

    syncer, _ = _syncer(tmp_path)
    watch = Watch(path=tmp_path / "runs")
    index = save_llama(watch.path / "llama", sharded=True)
    _aged(index, 300)
    for shard in _shards(index):
        _aged(shard, 200)
    assert syncer.process(watch, index, closed=True).status is Status.CONVERTED
    downloaded = save_llama(watch.path / "downloaded", sharded=True)
    first, *others = _shards(downloaded)
    _aged(first, 2 * INCOMPLETE_GRACE_SECONDS + 1)
    _aged(downloaded, 2 * INCOMPLETE_GRACE_SECONDS)
    for shard in others:
        _aged(shard, INCOMPLETE_GRACE_SECONDS + 1)
    assert syncer.process(watch, downloaded, closed=True).status is Status.CONVERTED


@pytest.mark.root
def test_a_full_state_disk_is_said_once_while_it_lasts_and_each_file_backs_off(tmp_path: Path, small_fs: Path) -> None:
    """Every file waiting said "state database: database or disk is full" every 5 s: 1,200 lines a minute for
    100 files, pushing the sync log's history out. Once while it lasts now, each file retried with backoff."""
    log = tmp_path / "sync.log.jsonl"
    syncer = Syncer(StateDB(small_fs / "state"), SyncLog(log), settle_seconds=0.0, hash_name=DEFAULT_HASH)
    watch = Watch(path=tmp_path / "runs")
    sources = [_saved_in(watch.path / f"run{i}") for i in range(3)]
    filler = fill_up(small_fs)
    outcomes = [syncer.process(watch, source, closed=True) for source in sources for _ in range(3)]
    assert {outcome.status for outcome in outcomes} == {Status.ERROR}
    assert [outcome.retry_in for outcome in outcomes[:3]] == [5.0, 10.0, 20.0]  # one file's looks, backing off
    said = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["status"] for r in said] == ["error"] and "disk is full" in said[0]["error"]
    filler.unlink()
    assert syncer.process(watch, sources[0], closed=True).status is Status.CONVERTED  # it heals
    fill_up(small_fs)
    assert syncer.process(watch, sources[1], closed=True).status is Status.ERROR  # a new fault: said again
    assert [json.loads(line)["status"] for line in log.read_text().splitlines()] == ["error", "converted", "error"]


def test_a_set_that_does_not_read_is_refused_once_not_retried_as_changing(tmp_path: Path) -> None:
    """A set's version is all its files': compared with the index's own stamp it always looked changed, so a
    set whose files disagree was "changed while it was being read" and retried forever, never refused."""
    syncer, log = _syncer(tmp_path)
    watch = Watch(path=tmp_path / "runs")
    directory = watch.path / "set"
    directory.mkdir(parents=True)
    for number, name in ((1, "a.weight"), (2, "b.weight")):
        save_file({name: torch.ones(4, 3)}, directory / f"model-0000{number}-of-00002.safetensors")
    index = directory / "model.safetensors.index.json"
    shard = "model-00001-of-00002.safetensors"  # b.weight is not there
    index.write_text(json.dumps({"metadata": {"total_size": 96}, "weight_map": {"a.weight": shard, "b.weight": shard}}))
    assert syncer.process(watch, index, closed=True).status is Status.REFUSED
    assert syncer.process(watch, index, closed=True).status is None  # said once
    (line,) = log.read_text().splitlines()
    assert json.loads(line)["status"] == "refused" and "b.weight" in json.loads(line)["error"]


def test_a_set_another_worker_has_is_looked_at_again_not_waited_for(tmp_path: Path) -> None:
    """A shard's event while another worker converts its set: the worker sat behind the set's lock for the
    whole conversion, making no progress, and was called stuck (the watchdog pings withheld, the daemon
    restarted, the conversion begun again)."""
    from hfsets import save_llama

    syncer, log = _syncer(tmp_path)
    watch = Watch(path=tmp_path / "runs")
    index = save_llama(watch.path / "llama", sharded=True)
    converting = threading.Event()
    done = threading.Event()
    outcomes = []

    def progress(_done: int, _total: int) -> None:
        converting.set()
        assert done.wait(60)  # the first worker, in the middle of writing

    syncer.progress_for = lambda _path: progress
    first = threading.Thread(target=lambda: outcomes.append(syncer.process(watch, index, closed=True)))
    first.start()
    assert converting.wait(60)
    shard = index.parent / "model-00002-of-00003.safetensors"
    second = syncer.process(watch, shard, closed=True)  # at once: not behind the first
    done.set()
    first.join(60)
    assert second.status is None and second.retry_in is not None
    assert [outcome.status for outcome in outcomes] == [Status.CONVERTED]
    assert syncer.process(watch, shard, closed=True).status is None  # converted already: nothing to do
    assert [json.loads(line)["status"] for line in log.read_text().splitlines()] == ["converted"]


def test_the_checks_after_the_pass_tell_that_the_work_moves_on(tmp_path: Path) -> None:
    """A cast's check reads the source again and `--verify full` reads everything back, writing nothing: a
    conversion spent half its time there without a word, and a long one was called stuck."""
    source = _saved_in(tmp_path)
    for name, options in (("cast", {"store": StoreOptions(precision="f16")}), ("audited", {"verify": "full"})):
        told: list[str] = []
        request = ConvertRequest(source=source, dest=tmp_path / f"{name}.bpk", alive=partial(told.append, name))
        convert(dataclasses.replace(request, **options))
        assert len(told) >= 3, name  # once per tensor at least: fc.weight, fc.bias, norm.weight


def test_the_locks_of_sets_seen_are_dropped_once_many(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One lock per set index ever seen, kept for good: memory grew with every set a long training run saved."""
    syncer, _ = _syncer(tmp_path)
    monkeypatch.setattr(Syncer, "MAX_SET_LOCKS", 2)
    watch = Watch(path=tmp_path / "runs")
    for n in range(6):
        index = watch.path / f"set-{n}" / "model.safetensors.index.json"
        index.parent.mkdir(parents=True)
        index.write_text("{}")  # (a broken index: what is decided matters not here, the lock taken does)
        syncer.process(watch, index, closed=True)
        assert len(syncer._set_locks) <= 3
