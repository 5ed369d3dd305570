"""Ownership is proven, never claimed: a destination is syncd's own only when a record syncd made says so and
the file is still what was published. The file's own metadata is a hint, never proof: a user who loads
syncd's output, changes the weights and saves with the metadata kept (`save_file(tensors, path,
metadata=f.metadata())`) owns that file, and syncd never replaces it, in any order of events, with or
without its state directory. Real daemons, real files, real signals."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from clusterutil import stop_while_converting
from convcheck import run_cli
from daemonutil import DaemonRun, stop_cleanly, wait_until
from safetensors.numpy import safe_open, save, save_file

from syncd.daemon.config import Watch
from syncd.daemon.state import StateDB
from syncd.daemon.statuses import Status
from syncd.daemon.sync import Syncer
from syncd.daemon.synclog import SyncLog
from syncd.engine.convert import ConvertRequest, convert
from syncd.engine.hashing import DEFAULT_HASH

pytestmark = pytest.mark.daemon


def checkpoint(seed: int, width: int = 16) -> bytes:
    """A PyTorch-layout checkpoint; same seed, same bytes, and every seed the same header."""
    rng = np.random.default_rng(seed)
    return save(
        {
            "fc.weight": rng.standard_normal((width, width * 3 // 4), dtype=np.float32),
            "fc.bias": rng.standard_normal(width, dtype=np.float32),
        }
    )


def burnpack(seed: int, work: Path, width: int = 16) -> bytes:
    """The Burn checkpoint a trainer would save: syncd's conversion of `checkpoint(seed)`, made under another
    name (a file that names its own output as its source is taken for syncd's output, not converted back)."""
    work.mkdir(parents=True, exist_ok=True)
    source = work / "trainer.safetensors"
    source.write_bytes(checkpoint(seed, width))
    convert(ConvertRequest(source=source, dest=work / "trainer.bpk"))
    data = (work / "trainer.bpk").read_bytes()
    shutil.rmtree(work)
    return data


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)


def edit_keeping_metadata(path: Path) -> bytes:
    """What a user does to syncd's output: load it, change the weights, save over it with the metadata kept
    (syncd.source and the source hash included). Returns the bytes saved."""
    with safe_open(os.fspath(path), "np") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    assert metadata and any(key.startswith("syncd.") for key in metadata)
    tensors = {name: tensor + np.float32(1.0) for name, tensor in tensors.items()}
    save_file(tensors, os.fspath(path), metadata=metadata)
    return path.read_bytes()


def converted_once(
    make_daemon: Callable[..., DaemonRun], work: Path, width: int = 16, **settings: object
) -> tuple[DaemonRun, Path, Path]:
    """A running daemon watching `runs` (Burn -> PyTorch, `settings` added to the watch or, for `cluster`, to the
    config) that has converted a trainer's first save: (the daemon, the source, its output)."""
    cluster = {k: settings.pop(k) for k in ("cluster",) if k in settings}
    run = make_daemon([{"path": "runs", "direction": "bpk->safetensors", **settings}], **cluster)
    runs = run.watch_dir()
    source, output = runs / "model.bpk", runs / "model.safetensors"
    write_file(source, burnpack(1, work, width))
    run.start()
    run.wait_for("converted", [source])
    return run, source, output


def lines_for(run: DaemonRun, source: Path) -> list[str]:
    return [r["status"] for r in run.records() if r.get("source") == str(source)]


def next_line_for(run: DaemonRun, source: Path, seen: int) -> str:
    """Wait for the daemon's next sync log line about `source` after the first `seen`; returns its status."""

    def more() -> list[str] | None:
        assert run.running(), run.stderr()
        statuses = lines_for(run, source)
        return statuses if len(statuses) > seen else None

    try:
        return wait_until(more, 60, f"a line about {source.name}")[seen]
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{run.log_text()}\n{run.stderr()}") from None


# what a file that is not syncd's output of this source gets, by on_exists
REFUSAL = {"skip": "skipped", "error": "conflict"}


def after_a_rescan(run: DaemonRun) -> None:
    run.send(signal.SIGUSR1)  # `syncd retry`'s signal: a scan of every watch, as the safety rescan does


def after_a_restart(run: DaemonRun) -> None:
    stop_cleanly(run)
    run.start()


def after_a_restart_without_state(run: DaemonRun) -> None:
    stop_cleanly(run)
    shutil.rmtree(run.state_dir)  # a new machine, a wiped state directory, another node
    run.start()


@pytest.mark.parametrize("on_exists", ["skip", "error"])
@pytest.mark.parametrize(
    "then", [after_a_rescan, after_a_restart, after_a_restart_without_state], ids=lambda f: f.__name__
)
def test_an_output_edited_with_its_metadata_kept_is_never_adopted_nor_replaced(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path, on_exists: str, then: Callable[[DaemonRun], None]
) -> None:
    run, source, output = converted_once(make_daemon, tmp_path / "work", on_exists=on_exists)
    seen = len(lines_for(run, source))

    users = edit_keeping_metadata(output)
    then(run)
    # the daemon looks at the source again and finds a file that is not its output of it
    assert next_line_for(run, source, seen) == REFUSAL[on_exists], run.log_text()
    seen = len(lines_for(run, source))
    if on_exists == "skip":
        # with its record there, no state was lost: no advice to adopt (the next save would then replace the
        # user's edit; a set's, delete its shards); without it, adopting is what a lost state asks for
        (said,) = [r for r in run.records() if r["status"] == "skipped"]
        lost = then is after_a_restart_without_state
        assert ("--adopt" in said["reason"]) is lost, said["reason"]
        assert ("its record shows" in said["reason"]) is not lost, said["reason"]

    write_file(source, burnpack(2, tmp_path / "work"))  # the trainer saves again
    assert next_line_for(run, source, seen) == REFUSAL[on_exists], run.log_text()
    run.quiet(0.5)
    assert output.read_bytes() == users
    assert "in_sync" not in lines_for(run, source), run.log_text()
    stop_cleanly(run)


def test_an_edit_while_stopped_then_a_new_save_then_a_start_without_state_replaces_nothing(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    run, source, output = converted_once(make_daemon, tmp_path / "work")
    stop_cleanly(run)
    users = edit_keeping_metadata(output)
    write_file(source, burnpack(2, tmp_path / "work"))
    shutil.rmtree(run.state_dir)
    seen = len(lines_for(run, source))
    run.start()
    assert next_line_for(run, source, seen) == "skipped", run.log_text()
    seen += 1
    write_file(source, burnpack(3, tmp_path / "work"))
    assert next_line_for(run, source, seen) == "skipped", run.log_text()
    assert output.read_bytes() == users
    stop_cleanly(run)


def test_after_a_lost_state_retry_adopt_makes_the_outputs_naming_their_sources_the_daemons_again(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    """Saved while no record was kept, syncd's own output of an older version of its source cannot be told from
    an edit (the test above): skipped at every save. `syncd retry --adopt` is the operator vouching for it: an
    output that names its source is the daemon's again, converted anew at once; one that names nothing is
    someone else's still."""
    run, source, output = converted_once(make_daemon, tmp_path / "work")
    stranger, theirs = source.with_name("other.bpk"), output.with_name("other.safetensors")
    theirs.write_bytes(checkpoint(7))  # someone's own file where other.bpk's output would go
    write_file(stranger, burnpack(8, tmp_path / "work"))
    run.wait_for("skipped", [stranger])
    stop_cleanly(run)
    write_file(source, burnpack(2, tmp_path / "work"))
    shutil.rmtree(run.state_dir)
    seen = len(lines_for(run, source))
    run.start()
    assert next_line_for(run, source, seen) == "skipped", run.log_text()
    said = [r for r in run.records() if r.get("source") == str(source)][-1].get("reason", "")
    assert said.endswith(f"`syncd retry -c {run.config_path} --adopt` makes it the daemon's again"), run.log_text()
    adopted = run_cli("retry", "-c", run.config_path, "--adopt")
    assert adopted.returncode == 0, adopted.stderr
    assert adopted.stdout.splitlines() == [
        f"{output}: adopted as the output of model.bpk",
        f"1 output(s) adopted; the daemon (pid {run.proc.pid if run.proc else None}) is scanning",
        f"{stranger}: its output {theirs} does not name it in syncd.source: someone else's file, left alone",
    ]
    assert next_line_for(run, source, seen + 1) == "updated", run.log_text()
    (tmp_path / "expected").mkdir()
    shutil.copy(source, tmp_path / "expected" / "model.bpk")
    convert(ConvertRequest(source=tmp_path / "expected" / "model.bpk"))
    assert output.read_bytes() == (tmp_path / "expected" / "model.safetensors").read_bytes()
    assert theirs.read_bytes() == checkpoint(7)
    refused = run_cli("retry", "-c", run.config_path, "--adopt", stranger)
    assert refused.returncode == 1 and "someone else's file, left alone" in refused.stdout, refused.stdout
    stop_cleanly(run)


def test_an_unedited_output_is_in_sync_after_a_restart_without_state_and_then_updated(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    """The other side: syncd's own output, untouched, is recognised without a record (its bytes are exactly the
    conversion of the current source) and stays syncd's to update."""
    run, source, output = converted_once(make_daemon, tmp_path / "work")
    published = output.read_bytes()
    after_a_restart_without_state(run)
    run.wait_for("in_sync", [source])
    assert output.read_bytes() == published
    seen = len(lines_for(run, source))
    write_file(source, burnpack(2, tmp_path / "work"))
    assert next_line_for(run, source, seen) == "updated", run.log_text()
    assert output.read_bytes() != published
    stop_cleanly(run)


# ------------------------------------------------------------------------------------------ on a shared filesystem

SHARED = {"cluster": {"shared": True, "poll_interval": 0.5}}


@pytest.mark.parametrize("then", [after_a_rescan, after_a_restart_without_state], ids=lambda f: f.__name__)
def test_on_a_shared_tree_the_publishers_record_does_not_make_an_edited_output_syncds(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path, then: Callable[[DaemonRun], None]
) -> None:
    """The claim file beside the output records the publish; a user's edit with the metadata kept is not
    the file recorded (its inode, size, mtime or ctime differ), so the record proves nothing about it."""
    run, source, output = converted_once(make_daemon, tmp_path / "work", **SHARED)
    assert (source.parent / ".model.safetensors.syncd-claim").stat().st_size > 0  # the record of the publish
    seen = len(lines_for(run, source))
    users = edit_keeping_metadata(output)
    then(run)
    assert next_line_for(run, source, seen) == "skipped", run.log_text()
    write_file(source, burnpack(2, tmp_path / "work"))
    assert next_line_for(run, source, seen + 1) == "skipped", run.log_text()
    assert output.read_bytes() == users
    stop_cleanly(run)


def test_on_a_shared_tree_an_untouched_output_is_adopted_from_its_record_then_updated(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    """Without its state, a node takes its own (or another node's) output from the record beside it: quietly,
    without converting again, and it stays syncd's to update."""
    run, source, output = converted_once(make_daemon, tmp_path / "work", **SHARED)
    published = os.stat(output)
    after_a_restart_without_state(run)

    def adopted() -> bool:
        with StateDB(run.state_dir) as state:
            row = state.get(source)
        return row is not None and row.status == "in_sync"

    wait_until(adopted, 30, "the output adopted from its record")
    assert lines_for(run, source) == ["converted"], run.log_text()  # no second conversion, nothing said
    assert os.stat(output).st_ino == published.st_ino
    write_file(source, burnpack(2, tmp_path / "work"))
    assert next_line_for(run, source, 1) == "updated", run.log_text()
    stop_cleanly(run)


def test_an_edit_made_while_syncd_converts_the_next_save_is_not_replaced(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    """The daemon is held (SIGSTOP) with the next save's conversion in flight, the user edits the output with
    its metadata kept, the daemon goes on: the publish finds the output is no longer the one recorded, right
    before its rename, and replaces nothing."""
    run, source, output = converted_once(make_daemon, tmp_path / "work", width=2048)
    assert run.proc is not None
    pid = run.proc.pid
    write_file(source, burnpack(2, tmp_path / "work", width=2048))

    stop_while_converting([pid])  # held with the next save's conversion in flight
    try:
        users = edit_keeping_metadata(output)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert next_line_for(run, source, 1) == "conflict", run.log_text()
    assert output.read_bytes() == users
    stop_cleanly(run)


# ------------------------------------------------------- a checkpoint made by `syncd convert` from its namesake


def burnpack_naming_its_output(seed: int, work: Path) -> bytes:
    """`syncd convert model.safetensors` run elsewhere: a model.bpk whose `syncd.source` names model.safetensors,
    the very name the daemon converts it to."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "model.safetensors").write_bytes(checkpoint(seed))
    convert(ConvertRequest(source=work / "model.safetensors"))
    data = (work / "model.bpk").read_bytes()
    shutil.rmtree(work)
    return data


def test_a_bpk_converted_elsewhere_from_its_namesake_is_converted_again_at_every_save(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    """A .bpk that names model.safetensors is taken for syncd's output of it only while no record says
    otherwise: once the daemon converted it into model.safetensors, its next save is converted again (it was
    left stale, silently, as if it were the daemon's own output), and the daemon's output is not converted
    back."""
    run = make_daemon([{"path": "runs", "direction": "both"}])
    runs = run.watch_dir()
    source, output = runs / "model.bpk", runs / "model.safetensors"
    write_file(source, burnpack_naming_its_output(1, tmp_path / "work"))
    run.start()
    run.wait_for("converted", [source])
    first = output.read_bytes()
    write_file(source, burnpack_naming_its_output(2, tmp_path / "work"))
    assert next_line_for(run, source, 1) == "updated", run.log_text()
    assert output.read_bytes() != first
    with safe_open(os.fspath(output), "np") as f:
        assert f.metadata()["syncd.source"] == "model.bpk"
    run.quiet(1.0)
    assert [r["status"] for r in run.records()] == ["started", "converted", "updated"], run.log_text()
    stop_cleanly(run)


def test_a_broken_bpk_naming_its_namesake_is_not_taken_for_an_output(
    make_daemon: Callable[..., DaemonRun], tmp_path: Path
) -> None:
    """What a .bpk says of itself is read without its table; a .bpk naming model.safetensors, which is there,
    would then be taken for an output converted back and left alone, with no line in the log. Its table is
    broken: the file is opened in full before that, and it is a file like any other, whose destination is
    someone else's file (skipped: on_exists's default)."""
    from formatgen import bpk_bytes, descriptor

    run = make_daemon([{"path": "runs", "direction": "bpk->safetensors"}])
    runs = run.watch_dir()
    write_file(runs / "model.safetensors", checkpoint(1))
    said = {"syncd.source": "model.safetensors", "syncd.layout": "burn"}
    source = runs / "model.bpk"
    write_file(source, bpk_bytes({"w": descriptor("F32", [16], 0, 64)}, metadata=said))
    run.start()
    run.wait_for("skipped", [source])
    assert [r["status"] for r in run.records() if r.get("source") == str(source)] == ["skipped"], run.log_text()
    stop_cleanly(run)


def test_an_output_published_beside_its_source_is_not_converted_into_a_mirror_set_up_later(tmp_path: Path) -> None:
    """The watch wrote model.bpk beside model.safetensors, then was given a mirror: model.bpk is still the
    daemon's own output of the model.safetensors beside it, not a checkpoint to convert into the mirror
    (where it made a stale model.safetensors beside the new model.bpk, for good)."""
    runs, mirror = tmp_path / "runs", tmp_path / "mirror"
    runs.mkdir()
    mirror.mkdir()
    syncer = Syncer(StateDB(tmp_path / "state"), SyncLog(tmp_path / "log"), settle_seconds=0.0, hash_name=DEFAULT_HASH)
    source = runs / "model.safetensors"
    write_file(source, checkpoint(1))
    beside = Watch(path=runs, direction="both")
    assert syncer.process(beside, source, closed=True).status is Status.CONVERTED
    mirrored = Watch(path=runs, direction="both", mirror=mirror)
    write_file(source, checkpoint(2))
    assert syncer.process(mirrored, source, closed=True).status is Status.CONVERTED
    assert syncer.process(mirrored, runs / "model.bpk", closed=True).status is None
    assert sorted(path.name for path in mirror.iterdir()) == ["model.bpk"]


def _node(tmp_path: Path, name: str, runs: Path) -> Syncer:
    """One node's daemon decisions, with its own state, over a tree shared with other nodes."""
    syncer = Syncer(
        StateDB(tmp_path / name), SyncLog(tmp_path / f"{name}.log"), settle_seconds=0.0, hash_name=DEFAULT_HASH
    )
    syncer.shared = frozenset({runs})
    return syncer


@pytest.mark.parametrize("name", ["ckpt-1.safetensors", "ckpt-1.pt"])
def test_an_output_whose_source_was_rotated_away_is_left_to_a_node_without_state(tmp_path: Path, name: str) -> None:
    """A trainer removed ckpt-1.safetensors and kept syncd's ckpt-1.bpk; a node that then started without state
    took that output for a checkpoint and made ckpt-1.safetensors again, which the first node converted as its
    source saved again, and the two converted each other's outputs for ever (a .pt's: a third file, stale).
    The claim's record beside the output says which node published it from what."""
    runs = tmp_path / "runs"
    runs.mkdir()
    watch = Watch(path=runs, direction="both", include=("*.bpk", "*.safetensors", "*.pt"))
    source, output = runs / name, runs / "ckpt-1.bpk"
    if source.suffix == ".pt":
        torch.save({"fc.weight": torch.ones(12, 16), "fc.bias": torch.zeros(12)}, source)
    else:
        write_file(source, checkpoint(1))
    assert _node(tmp_path, "node-a", runs).process(watch, source, closed=True).status is Status.CONVERTED
    source.unlink()
    outcome = _node(tmp_path, "node-b", runs).process(watch, output, closed=True)
    assert outcome.status is None and outcome.retry_in is None
    assert sorted(path.name for path in runs.iterdir() if not path.name.startswith(".")) == ["ckpt-1.bpk"]


@pytest.mark.parametrize("shared", [True, False])
def test_the_bpk_of_a_checkpoint_converted_to_a_set_is_not_converted_back_into_a_second_copy(
    tmp_path: Path, shared: bool
) -> None:
    """With `shard_size`, model.safetensors's output model.bpk names model.safetensors, not the set its own
    conversion would be: a node without the state that knows it (another node, a wiped state) converted it
    into model.safetensors.index.json and its shards, a second copy of the model in the user's tree."""
    runs = tmp_path / "runs"
    runs.mkdir()
    watch = Watch(path=runs, direction="both", shard_size=1024)
    source, output = runs / "model.safetensors", runs / "model.bpk"
    write_file(source, checkpoint(1, width=64))
    first = _node(tmp_path, "node-a", runs)
    if not shared:
        first.shared = frozenset()
    assert first.process(watch, source, closed=True).status is Status.CONVERTED
    second = _node(tmp_path, "node-b", runs)
    if not shared:
        second.shared = frozenset()
    outcome = second.process(watch, output, closed=True)
    assert outcome.status is None and outcome.retry_in is None
    assert sorted(path.name for path in runs.iterdir() if not path.name.startswith(".")) == [
        "model.bpk",
        "model.safetensors",
    ]


@pytest.mark.parametrize("on_exists", ["skip", "overwrite"])
def test_a_set_another_node_made_from_a_bpk_is_its_output_to_a_one_direction_node(
    tmp_path: Path, on_exists: str
) -> None:
    """A `both` node with `shard_size` converts a trainer's model.bpk into a set; a set carries no syncd.source,
    so a `safetensors->bpk` node took it for a user's checkpoint whose destination exists: "skipped" at every
    save, or with on_exists: overwrite the trainer's model.bpk replaced by the set's conversion, and the two
    nodes then converting each other's outputs for ever. The claim's record beside the index says whose it is."""
    runs = tmp_path / "runs"
    runs.mkdir()
    source = runs / "model.bpk"
    trainers = burnpack(1, tmp_path / "work", width=64)
    write_file(source, trainers)
    both = Watch(path=runs, direction="both", shard_size=1024)
    assert _node(tmp_path, "node-a", runs).process(both, source, closed=True).status is Status.CONVERTED
    index = runs / "model.safetensors.index.json"
    assert index.exists()
    one_way = Watch(path=runs, direction="safetensors->bpk", on_exists=on_exists)
    outcome = _node(tmp_path, "node-b", runs).process(one_way, index, closed=True)
    assert outcome.status is None and outcome.retry_in is None  # silent: another node's output
    assert source.read_bytes() == trainers


def test_the_converted_line_says_what_convert_says_without_v(tmp_path: Path) -> None:
    """A remap rule that matched nothing and module indices with gaps Burn cannot load: `syncd convert` says
    both; the daemon's line (journal, `syncd log`) said neither, so a typo in a watch's rule went unseen."""
    runs = tmp_path / "runs"
    runs.mkdir()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    source = runs / "m.safetensors"
    save_file({k: v.contiguous().numpy() for k, v in model.state_dict().items()}, os.fspath(source))
    log = SyncLog(tmp_path / "log")
    syncer = Syncer(StateDB(tmp_path / "state"), log, settle_seconds=0.0, hash_name=DEFAULT_HASH)
    watch = Watch(path=runs, direction="both", remap=((r"^encoder\.", "enc."),))
    assert syncer.process(watch, source, closed=True).status is Status.CONVERTED
    lines = [json.loads(text) for text in (tmp_path / "log").read_text().splitlines()]
    (line,) = [record for record in lines if record["status"] == "converted"]
    assert "remap rule '^encoder\\.' matched no tensor name" in line["reason"], line
    assert "module indices with gaps: 0, 2" in line["reason"], line
