"""A daemon killed after putting an output in place and before recording the publish: the output is still
provably syncd's, by the record made right before placing it (in the state, and in the claim for the other
nodes), so the next save of the source updates it. Without that record the output was someone else's file
to every later look, left alone for good (the kill -9 soak, tests/soak.py, found it).

The daemon's decisions run in this process (syncd.daemon.sync.Syncer), on real files, a real state database
and real claim files; the kill is a BaseException raised where the daemon records the publish, which nothing
of syncd's catches, so that what it leaves on disk is what a SIGKILL at that step leaves."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_training_loop import checkpoint, conversion_of, write_file

from syncd.daemon import sync as sync_module
from syncd.daemon.claims import claim_path, try_claim
from syncd.daemon.config import Watch
from syncd.daemon.ownership import PLACED_UNRECORDED
from syncd.daemon.state import StateDB
from syncd.daemon.statuses import Status
from syncd.daemon.sync import Syncer
from syncd.daemon.synclog import SyncLog
from syncd.engine import publish as publish_module
from syncd.engine.convert import ConvertRequest, convert
from syncd.engine.hashing import DEFAULT_HASH


class Killed(BaseException):
    """The daemon's death at the step it is raised from."""


class Node:
    """One daemon's decisions, with its own state directory, over a watched tree."""

    def __init__(self, root: Path, runs: Path, shared: bool) -> None:
        self.state = StateDB(root / "state")
        self.log = root / "sync.log.jsonl"
        self.syncer = Syncer(self.state, SyncLog(self.log), settle_seconds=0.0, hash_name=DEFAULT_HASH)
        self.watch = Watch(path=runs, direction="safetensors->bpk")
        if shared:
            self.syncer.shared = frozenset({runs})

    def process(self, source: Path) -> Status | None:
        return self.syncer.process(self.watch, source, closed=True).status

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def killed_at_the_record_of_the_publish(self, source: Path) -> None:
        def record(*_args: object, **_kwargs: object) -> None:
            raise Killed

        self.state.record = record  # type: ignore[method-assign]
        with pytest.raises(Killed):
            self.process(source)
        self.state.close()


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "runs"
    path.mkdir()
    yield path


def save(path: Path, seed: int) -> bytes:
    """A training loop's re-save: a new file renamed over the old name."""
    data = checkpoint(seed, width=16)
    write_file(path.with_name("incoming.partial"), data)
    os.replace(path.with_name("incoming.partial"), path)
    return data


def killed_right_after_placing(tmp_path: Path, runs: Path, *, first: bool, shared: bool) -> tuple[Path, Path]:
    """(the source, its output): the output of the source's latest save placed by a daemon that died before
    recording it (`first`: its first conversion; else an update of an earlier, recorded one)."""
    source, output = runs / "model.safetensors", runs / "model.bpk"
    node = Node(tmp_path / "node-a", runs, shared)
    if not first:
        save(source, 1)
        assert node.process(source) is Status.CONVERTED
    data = save(source, 2)
    node.killed_at_the_record_of_the_publish(source)
    assert output.read_bytes() == conversion_of(data, source.name, tmp_path / "expected")  # placed
    return source, output


@pytest.mark.parametrize("shared", [False, True], ids=["local", "shared"])
@pytest.mark.parametrize("first", [True, False], ids=["first-conversion", "update"])
def test_the_next_save_updates_an_output_placed_by_a_daemon_killed_before_recording_it(
    tmp_path: Path, runs: Path, first: bool, shared: bool
) -> None:
    source, output = killed_right_after_placing(tmp_path, runs, first=first, shared=shared)
    data = save(source, 3)
    node = Node(tmp_path / "node-a", runs, shared)  # the same daemon, restarted
    assert node.process(source) is Status.UPDATED
    assert output.read_bytes() == conversion_of(data, source.name, tmp_path / "expected")


@pytest.mark.parametrize("first", [True, False], ids=["first-conversion", "update"])
def test_another_node_updates_an_output_placed_by_a_node_killed_before_recording_it(
    tmp_path: Path, runs: Path, first: bool
) -> None:
    """The other node has no state of the dead one's: the record in the claim file proves the output."""
    source, output = killed_right_after_placing(tmp_path, runs, first=first, shared=True)
    data = save(source, 3)
    node = Node(tmp_path / "node-b", runs, shared=True)
    assert node.process(source) is Status.UPDATED
    assert output.read_bytes() == conversion_of(data, source.name, tmp_path / "expected")


@pytest.mark.parametrize("node", ["node-a", "node-b"], ids=["restarted", "another-node"])
def test_an_output_placed_from_the_source_as_it_still_is_is_adopted_without_converting_again(
    tmp_path: Path, runs: Path, node: str
) -> None:
    source, output = killed_right_after_placing(tmp_path, runs, first=False, shared=True)
    placed = os.stat(output)
    after = Node(tmp_path / node, runs, shared=True)
    said = len(after.lines())
    assert after.process(source) is Status.IN_SYNC
    # not converted again (a conversion's line gives its tensors); what the dead daemon never said is said now
    adopted = [json.loads(line) for line in after.lines()[said:]]
    assert [(r["status"], r["reason"], "tensors" in r) for r in adopted] == [("in_sync", PLACED_UNRECORDED, False)]
    assert os.stat(output).st_ino == placed.st_ino
    data = save(source, 3)  # and it stays syncd's to update
    assert after.process(source) is Status.UPDATED
    assert output.read_bytes() == conversion_of(data, source.name, tmp_path / "expected")


@pytest.mark.parametrize("node", ["node-a", "node-b"], ids=["restarted", "another-node"])
def test_an_output_placed_then_written_by_someone_else_is_left_alone(tmp_path: Path, runs: Path, node: str) -> None:
    """Written over after it was placed (even with the same bytes: its mtime changed), the file proves
    nothing any more: someone else's, which on_exists (skip) leaves as it is."""
    source, output = killed_right_after_placing(tmp_path, runs, first=False, shared=True)
    users = output.read_bytes()
    write_file(output, users)
    save(source, 3)
    assert Node(tmp_path / node, runs, shared=True).process(source) is Status.SKIPPED
    assert output.read_bytes() == users


def test_a_claims_record_of_placing_keeps_the_last_publish_and_the_publish_replaces_both(tmp_path: Path) -> None:
    from syncd.daemon.claims import Published

    dest = tmp_path / "model.bpk"
    last = Published("model.safetensors", (1, 2, 3, 4), (5, 6, 7, 8), node="a")
    placing = Published("model.safetensors", (11, 12, 13, 14), (15, 16, 17, 18), node="a-long-host-name" * 4)
    now = Published("model.safetensors", (11, 12, 13, 14), (15, 16, 17, 19), node="a")
    claim = try_claim(dest)
    assert claim is not None
    with claim:
        claim.record(last)
        claim.record_placing(placing)
        assert (claim.published(), claim.placing()) == (last, placing)
        claim.record(now)  # shorter than what it replaces: padded, never truncated first
        assert (claim.published(), claim.placing()) == (now, None)
    assert claim_path(dest).stat().st_size > len(now.to_bytes())


# ----------------------------------------------------------------------- a set: every file of it recorded


def set_carrying_bpk(seed: int, work: Path) -> bytes:
    """A .bpk made by `syncd convert` from a sharded set of `checkpoint(seed)` (its layout carried, so the
    daemon turns it back into that set: model-0000N-of-0000M.safetensors and model.safetensors.index.json)."""
    work.mkdir(parents=True)
    whole, split = work / "model.safetensors", work / "split"
    write_file(whole, checkpoint(seed, width=16))
    split.mkdir()
    convert(ConvertRequest(source=whole, dest=split, to_format="safetensors", shard_size=600))
    convert(ConvertRequest(source=split / "model.safetensors.index.json", dest=work / "model.bpk"))
    return (work / "model.bpk").read_bytes()


def save_bpk(path: Path, seed: int, work: Path) -> None:
    write_file(path.with_name("incoming.partial"), set_carrying_bpk(seed, work))
    os.replace(path.with_name("incoming.partial"), path)


def set_of(runs: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(runs.iterdir()) if p.name.startswith("model") and p.suffix != ".bpk"}


def set_node(tmp_path: Path, name: str, runs: Path, shared: bool) -> Node:
    node = Node(tmp_path / name, runs, shared)
    node.watch = Watch(path=runs, direction="bpk->safetensors")
    return node


def expected_set(seed: int, tmp_path: Path) -> dict[str, bytes]:
    expected = tmp_path / f"expected-{seed}"
    expected.mkdir()
    save_bpk(expected / "model.bpk", seed, tmp_path / f"made-{seed}")
    convert(ConvertRequest(source=expected / "model.bpk", dest=expected))
    return set_of(expected)


@pytest.mark.parametrize(
    ("shared", "node"), [(False, "node-a"), (True, "node-a"), (True, "node-b")], ids=["local", "shared", "another-node"]
)
def test_a_set_placed_by_a_daemon_killed_before_recording_it_is_adopted_then_updated(
    tmp_path: Path, runs: Path, shared: bool, node: str
) -> None:
    """Each file of a set is recorded right before it is placed (in the state, and in the claim for the other
    nodes): after a kill at the record of the publish, the set placed from the source as it still is is
    adopted (and said), and the next save replaces it."""
    source = runs / "model.bpk"
    save_bpk(source, 1, tmp_path / "v1")
    set_node(tmp_path, "node-a", runs, shared).killed_at_the_record_of_the_publish(source)
    placed = set_of(runs)
    assert placed == expected_set(1, tmp_path)

    after = set_node(tmp_path, node, runs, shared)
    assert after.process(source) is Status.IN_SYNC
    assert [json.loads(line)["reason"] for line in after.lines()[-1:]] == [PLACED_UNRECORDED]
    assert set_of(runs) == placed
    save_bpk(source, 2, tmp_path / "v2")
    assert after.process(source) is Status.UPDATED
    assert set_of(runs) == expected_set(2, tmp_path) != placed


def test_another_node_updates_a_set_published_by_the_first(tmp_path: Path, runs: Path) -> None:
    """On a shared tree the claim records every file of the set published: another node, without the first
    one's state, proves the set by it and updates it at the next save (and adopts it quietly before)."""
    source = runs / "model.bpk"
    save_bpk(source, 1, tmp_path / "v1")
    assert set_node(tmp_path, "node-a", runs, shared=True).process(source) is Status.CONVERTED
    other = set_node(tmp_path, "node-b", runs, shared=True)
    assert other.process(source) is Status.IN_SYNC
    save_bpk(source, 2, tmp_path / "v2")
    assert other.process(source) is Status.UPDATED
    assert set_of(runs) == expected_set(2, tmp_path)
    shard = next(path for path in runs.iterdir() if "-of-" in path.name)
    write_file(shard, shard.read_bytes())  # someone else's file now: the set is no longer provably syncd's
    save_bpk(source, 3, tmp_path / "v3")
    assert set_node(tmp_path, "node-a", runs, shared=True).process(source) is Status.SKIPPED


def test_a_stale_claim_record_does_not_make_an_output_a_source_on_another_node(tmp_path: Path, runs: Path) -> None:
    """model.bpk's claim still records its conversion from a model.safetensors since replaced by the daemon's
    own output of a new model.bpk: that record no longer describes model.bpk, so the other node takes the
    output for what it is, the daemon's (nothing logged), not for a source whose destination is someone
    else's (it logged `skipped`)."""
    pytorch, burn = runs / "model.safetensors", runs / "model.bpk"
    node = Node(tmp_path / "node-a", runs, shared=True)
    node.watch = Watch(path=runs, direction="both")
    write_file(pytorch, checkpoint(1, width=16))
    assert node.process(pytorch) is Status.CONVERTED  # the claim of model.bpk records model.safetensors
    pytorch.unlink()
    write_file(burn, conversion_of(checkpoint(2, width=16), "trainer.safetensors", tmp_path / "trainer"))
    assert node.process(burn) is Status.CONVERTED  # a Burn job's save: model.safetensors is its conversion
    other = Node(tmp_path / "node-b", runs, shared=True)
    other.watch = Watch(path=runs, direction="both")
    assert other.process(pytorch) is None
    assert other.lines() == []


@pytest.mark.parametrize("shared", [False, True], ids=["local", "shared"])
@pytest.mark.parametrize("first", [True, False], ids=["first-conversion", "update"])
def test_a_file_renamed_over_the_output_right_after_it_was_placed_is_never_taken_for_syncds(
    tmp_path: Path, runs: Path, monkeypatch: pytest.MonkeyPatch, first: bool, shared: bool
) -> None:
    """Another writer renames its own file over the output in the instant after syncd placed it (here: from
    the publish's last step, the directory's fsync). Recorded as syncd's, that file would be replaced at
    the source's next save; it is a conflict instead, and stays the writer's."""
    source, output = runs / "model.safetensors", runs / "model.bpk"
    node = Node(tmp_path / "node-a", runs, shared)
    if not first:
        save(source, 1)
        assert node.process(source) is Status.CONVERTED
    users = b"the other writer's file"
    sync_directory = publish_module._fsync_directory

    def renamed_over_right_after_placing(dest: Path) -> None:
        write_file(runs / "theirs.partial", users)
        os.replace(runs / "theirs.partial", output)
        sync_directory(dest)

    monkeypatch.setattr(publish_module, "_fsync_directory", renamed_over_right_after_placing)
    save(source, 2)
    assert node.process(source) is Status.CONFLICT
    monkeypatch.undo()
    said = json.loads(node.lines()[-1])
    assert (said["status"], said["source"]) == ("conflict", str(source))
    assert "replaced by another writer right after syncd put its output there" in said["error"]
    save(source, 3)
    assert node.process(source) is Status.SKIPPED
    assert output.read_bytes() == users


def test_a_claim_held_longer_than_any_conversion_is_said_once(
    tmp_path: Path, runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whoever holds an output's claim keeps it from being converted (a process that may open the claim file, a
    dead node's lock an NFSv3 server keeps): said once it has been held past any conversion's length."""
    source = runs / "model.safetensors"
    save(source, seed=1)
    holder = try_claim(runs / "model.bpk")
    assert holder is not None
    with holder:
        patient = Node(tmp_path / "node-a", runs, shared=True)
        assert patient.process(source) is None  # held: looked at again later, nothing said
        monkeypatch.setattr(sync_module, "CLAIM_HELD_WARNING_SECONDS", 0.0)
        node = Node(tmp_path / "node-b", runs, shared=True)
        for _ in range(3):
            assert node.process(source) is None
        assert patient.lines() == []
        (line,) = node.lines()
        record = json.loads(line)
        assert record["status"] == "warning" and record["source"] == str(source)
        assert record["reason"].startswith(f"the output's claim {claim_path(runs / 'model.bpk')} has been held")
    assert node.process(source) is Status.CONVERTED


def test_a_claim_wait_of_a_source_that_went_is_no_part_of_the_next_one(tmp_path: Path, runs: Path) -> None:
    """A source removed while its claim was held (a trainer's rotation) left its wait behind: the next file of
    that name whose claim was held a moment got the 30-minute warning at once, and waited its longest retry."""
    now = [1000.0]
    node = Node(tmp_path / "node", runs, shared=True)
    node.syncer.clock = lambda: now[0]
    source = runs / "model.safetensors"
    save(source, seed=1)
    holder = try_claim(runs / "model.bpk")
    assert holder is not None
    with holder:
        first = node.syncer.process(node.watch, source, closed=True)
        assert first.status is None and first.retry_in == 0.25
        now[0] += 1790.0  # the source went meanwhile; nothing looked at it since
        again = node.syncer.process(node.watch, source, closed=True)  # its successor, a moment held
        assert again.retry_in == 0.25 and node.lines() == []
    assert node.process(source) is Status.CONVERTED
