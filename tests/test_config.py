"""The daemon config: defaults, types, line numbers in messages, path resolution, safety refusals."""

from __future__ import annotations

import dataclasses
import grp
import io
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import REPO

from syncd.cli.check_config import run_check_config
from syncd.daemon.config import (
    DEFAULT_POLL_INTERVAL,
    check_config,
    load_config,
)
from syncd.errors import ConfigError

NOBODY = 65534


def write_config(directory: Path, text: str, name: str = "syncd.yaml", mode: int = 0o644) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    path.chmod(mode)
    return path


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    (tmp_path / "runs").mkdir()
    return tmp_path / "runs"


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return str(caught.value)


def test_minimal_config_gets_documented_defaults(tmp_path: Path, runs: Path) -> None:
    config = load_config(write_config(tmp_path, "watches:\n  - path: runs\n"))
    assert config.workers == 2
    assert config.settle_seconds == 1.0 and config.unleased_settle_seconds == 10.0
    assert config.poll_interval is None
    assert config.state_dir == tmp_path.resolve() / "state"
    assert config.log.path == tmp_path.resolve() / "syncd.log.jsonl"
    assert (config.log.max_bytes, config.log.backups, config.log.level) == (10485760, 5, "info")
    (watch,) = config.watches
    assert watch.path == runs.resolve()
    assert watch.recursive is True
    assert watch.include == ("*.bpk", "*.safetensors")
    assert watch.exclude == ()
    assert (watch.direction, watch.mirror, watch.on_exists, watch.layout) == ("both", None, "skip", "auto")
    assert dict(watch.modules) == {} and watch.poll is False
    assert config.polling_interval_for(watch) is None


def test_the_example_config_sets_every_setting_there_is() -> None:
    """config/syncd.yaml says it documents every setting: each key the schema knows is written in it."""
    import yaml

    from syncd.daemon.config.schema import CLUSTER_KEYS, LOG_KEYS, TOP_LEVEL_KEYS, WATCH_KEYS

    example = yaml.safe_load((REPO / "config" / "syncd.yaml").read_text())
    assert set(example) == set(TOP_LEVEL_KEYS)
    assert set(example["log"]) == set(LOG_KEYS) and set(example["cluster"]) == set(CLUSTER_KEYS)
    assert set(example["watches"][0]) == set(WATCH_KEYS)


def test_the_example_config_shows_each_settings_default(tmp_path: Path, runs: Path) -> None:
    """A line copied from config/syncd.yaml does what leaving it out does: the example showed
    `map_indices_contiguous: false`, which turns off the renumbering a `.pt` converted to `.bpk` gets by
    default (null: as Burn's store for the source's format)."""
    example = load_config(REPO / "config" / "syncd.yaml")
    minimal = load_config(write_config(tmp_path, "watches:\n  - path: runs\n"))
    (shown,), (default,) = example.watches, minimal.watches
    assert shown.module_map is not None and not shown.module_map.rules and shown.module_map.layout is None
    assert dataclasses.replace(shown, path=default.path, line=default.line, module_map=None) == default
    assert (
        dataclasses.replace(
            example,
            path=minimal.path,
            state_dir=minimal.state_dir,
            log=dataclasses.replace(example.log, path=minimal.log.path),
            watches=minimal.watches,
        )
        == minimal
    )


def test_full_config_is_read_and_relative_paths_resolve_against_the_config_dir(
    tmp_path: Path, runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mirror").mkdir()
    path = write_config(
        tmp_path,
        """
        workers: 4
        settle_seconds: 0.5
        unleased_settle_seconds: 3
        state_dir: ./var/state
        log: {path: logs/sync.jsonl, max_bytes: 1000, backups: 2, level: debug}
        poll_interval: 3
        hash: sha256
        watches:
          - path: ./runs
            recursive: false
            include: ["*.bpk"]
            exclude: ["*.tmp"]
            direction: bpk->safetensors
            output: {mirror: mirror}
            on_exists: overwrite
            layout: pytorch
            modules: {"encoder.*.proj": Linear, "embed": Embedding}
            poll: true
        """,
    )
    monkeypatch.chdir("/")  # the working directory must not matter
    config = load_config(path)
    assert config.workers == 4 and config.settle_seconds == 0.5 and config.poll_interval == 3.0
    assert config.unleased_settle_seconds == 3.0
    assert config.hash_name == "sha256"
    assert config.state_dir == tmp_path.resolve() / "var" / "state"
    assert config.log.path == tmp_path.resolve() / "logs" / "sync.jsonl"
    assert (config.log.max_bytes, config.log.backups, config.log.level) == (1000, 2, "debug")
    (watch,) = config.watches
    assert watch.recursive is False and watch.include == ("*.bpk",) and watch.exclude == ("*.tmp",)
    assert watch.direction == "bpk->safetensors" and watch.on_exists == "overwrite" and watch.layout == "pytorch"
    assert watch.mirror == tmp_path.resolve() / "mirror"
    assert dict(watch.modules) == {"encoder.*.proj": "Linear", "embed": "Embedding"}
    assert config.polling_interval_for(watch) == 3.0
    source = runs.resolve() / "exp1" / "model.bpk"
    assert watch.output_dir_for(source) == tmp_path.resolve() / "mirror" / "exp1"


def test_per_watch_poll_without_global_interval_uses_the_default(tmp_path: Path, runs: Path) -> None:
    config = load_config(write_config(tmp_path, "watches:\n  - {path: runs, poll: true}\n"))
    assert config.polling_interval_for(config.watches[0]) == DEFAULT_POLL_INTERVAL


def test_bad_enum_names_file_line_key_and_choices(tmp_path: Path, runs: Path) -> None:
    path = write_config(
        tmp_path,
        """\
        workers: 2
        watches:
          - path: runs
            direction: sideways
        """,
    )
    assert error_of(path) == (
        f"{path}:4: watches[0].direction: expected one of bpk->safetensors, safetensors->bpk, pt->bpk, both, "
        "got 'sideways'"
    )


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("workers: 0", "workers: expected an integer >= 1 and <= 32, got 0"),
        ("workers: true", "workers: expected an integer >= 1 and <= 32, got true"),
        ("workers: '2'", "workers: expected an integer >= 1 and <= 32, got '2'"),
        # a number of threads to start: 10**26 of them ate memory before the daemon said anything
        (
            "workers: 99999999999999999999999999",
            "workers: expected an integer >= 1 and <= 32, got 99999999999999999999999999",
        ),
        ("settle_seconds: -1", "settle_seconds: expected a number >= 0 and <= 604800, got -1"),
        ("settle_seconds: .nan", "settle_seconds: expected a number >= 0 and <= 604800, got nan"),
        # past time_t, a worker's wait raised OverflowError and every worker thread died
        ("settle_seconds: 10000000000", "settle_seconds: expected a number >= 0 and <= 604800, got 10000000000"),
        ("unleased_settle_seconds: -2", "unleased_settle_seconds: expected a number >= 0 and <= 604800, got -2"),
        ("poll_interval: 0", "poll_interval: expected a number > 0 and <= 604800 or null, got 0"),
        (
            "rescan_interval: 1000000000000",
            "rescan_interval: expected a number > 0 and <= 604800 or null, got 1000000000000",
        ),
        ("stuck_worker_seconds: 604801", "stuck_worker_seconds: expected a number > 0 and <= 604800, got 604801"),
        ("state_dir: 5", "state_dir: expected a path (a non-empty string, no NUL byte, under 4096 bytes), got 5"),
        (
            'state_dir: "st\\0ate"',
            "state_dir: expected a path (a non-empty string, no NUL byte, under 4096 bytes), got 'st\\x00ate'",
        ),
        ("settle_seconds: 2024-01-01", "settle_seconds: expected a number >= 0 and <= 604800, got the date 2024-01-01"),
        ("log: {level: loud}", "log.level: expected one of debug, info, warning, error, got 'loud'"),
        ("log: {max_bytes: -5}", "log.max_bytes: expected an integer >= 0, got -5"),
        ("log: {backups: 1000000000000}", "log.backups: expected an integer >= 0 and <= 1000, got 1000000000000"),
        ("log: {colour: red}", "log.colour: unknown key"),
        ("log: [1]", "log: expected a mapping, got a list"),
        ("worker: 3", "worker: unknown key (did you mean 'workers'?)"),
        ("hash: md5", "hash: expected one of xxh3_128, sha256, got 'md5'"),
    ],
)
def test_global_problems_are_reported_on_their_line(tmp_path: Path, runs: Path, line: str, expected: str) -> None:
    path = write_config(tmp_path, f"watches:\n  - path: runs\n{line}\n")
    assert error_of(path) == f"{path}:3: {expected}"


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("recursive: 'yes'", "watches[0].recursive: expected true or false, got 'yes'"),
        ("include: '*.bpk'", "watches[0].include: expected a list of non-empty strings, got '*.bpk'"),
        ("exclude: [1]", "watches[0].exclude: expected a list of non-empty strings, got a list"),
        ("on_exists: replace", "watches[0].on_exists: expected one of skip, error, overwrite, got 'replace'"),
        ("layout: Burn",
         "watches[0].layout: expected one of auto, pytorch, burn, keep, got 'Burn' (did you mean 'burn'?)"),
        ("output: elsewhere", "watches[0].output: expected 'beside' or {mirror: DIR}, got 'elsewhere'"),
        ("output: {mirror: nowhere}", "watches[0].output.mirror: {tmp}/nowhere does not exist"),
        ("direciton: both", "watches[0].direciton: unknown key (did you mean 'direction'?)"),
        ("modules: {x: Lineer}", "watches[0].modules['x']: expected a module kind, one of Linear, LinearInOut, "
         "Embedding, Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d, BatchNorm, LayerNorm, "
         "GroupNorm, InstanceNorm, RmsNorm, PRelu, MultiHeadAttention, Lstm, Gru, Rnn, Other, got 'Lineer' "
         "(did you mean 'Linear'?)"),
        ("modules: {a..b: Linear}", "watches[0].modules['a..b']: empty path segment in pattern"),
        ("modules: [Linear]", "watches[0].modules: expected a mapping of pattern -> kind or a file path, got a list"),
        ("include: []", "watches[0].include: matches no file direction both converts (*.bin, *.bpk, *.ckpt, *.pt, "
         "*.pth, *.safetensors, *.tar): the watch would convert nothing"),
        ("include: ['*.safetensors']\n    direction: bpk->safetensors", "watches[0].include: matches no file "
         "direction bpk->safetensors converts (*.bpk): the watch would convert nothing"),
        ("shard_size: 1KB\n    layout: keep", "watches[0].shard_size: with layout: keep, a Burn-layout .bpk "
         "(what Burn saves) keeps its layout, which a sharded set cannot hold (save_pretrained's sets are "
         "PyTorch's): each would fail; drop shard_size or layout: keep"),
        ("shard_size: 1.5", "watches[0].shard_size: shard size '1.5' is not a whole number of bytes (a unit: "
         "500MB, 5GB, 2GiB)"),
        ("output: {mirror: " + "a/" * 2100 + "}", "watches[0].output.mirror: expected a path (a non-empty string, "
         "no NUL byte, under 4096 bytes), got '" + "a/" * 2100 + "'"),
    ],
)  # fmt: skip
def test_watch_problems_are_reported_on_their_line(tmp_path: Path, runs: Path, entry: str, expected: str) -> None:
    path = write_config(tmp_path, f"watches:\n  - path: runs\n    {entry}\n")
    assert error_of(path) == f"{path}:3: {expected.replace('{tmp}', str(tmp_path.resolve()))}"


def test_non_directory_and_unset_watch_paths_are_refused_and_a_missing_one_is_not(tmp_path: Path) -> None:
    """A tree not there yet (a late mount) is watched once it is made (test_daemon.py): no problem here, or
    the whole daemon stopped for it; check-config warns of it."""
    (tmp_path / "file.bpk").write_bytes(b"")
    path = write_config(tmp_path, "watches:\n  - path: nowhere\n  - path: file.bpk\n  - recursive: false\n")
    root = tmp_path.resolve()
    assert check_config(path) == [
        f"{path}:3: watches[1].path: {root}/file.bpk is not a directory",
        f"{path}:4: watches[2].path: missing: every watch needs a directory",
    ]
    (tmp_path / "runs").mkdir()
    path = write_config(tmp_path, "watches:\n  - path: nowhere\n  - path: runs\n")
    out = io.StringIO()
    assert run_check_config(path, out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0] == f"warning: {path}: watch {root}/nowhere does not exist (yet): watched once it is made", lines
    assert lines[-1].endswith("valid (2 watches)") and len(lines) == 2, lines


def test_watches_are_required(tmp_path: Path) -> None:
    assert error_of(write_config(tmp_path, "workers: 1\n")).endswith(
        "syncd.yaml:1: watches: missing: at least one watch is required"
    )
    assert "watches: expected a non-empty list of watches, got an empty list" in error_of(
        write_config(tmp_path, "watches: []\n")
    )
    assert error_of(write_config(tmp_path, "")).endswith("syncd.yaml: the file is empty; it needs at least `watches:`")


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    path = write_config(tmp_path, "watches:\n  - path: runs\n    include: [unclosed\n")
    message = error_of(path)
    assert message.startswith(f"{path}:") and "invalid YAML" in message


def test_duplicate_keys_are_refused(tmp_path: Path, runs: Path) -> None:
    path = write_config(tmp_path, "workers: 1\nwatches:\n  - path: runs\nworkers: 3\n")
    assert error_of(path) == f"{path}:4: workers: duplicate key (the earlier one would be ignored)"


def test_a_config_only_syncds_user_or_root_can_edit_is_accepted_even_group_writable(tmp_path: Path, runs: Path) -> None:
    """umask 002 (Debian, Ubuntu, Fedora users) writes 0664 with the owner's private group: nobody else can edit it."""
    assert os.geteuid() == 0 and _members(0) <= {"root"}, "run the suite as root, whose group holds no one else"
    path = write_config(tmp_path, "watches:\n  - path: runs\n", mode=0o664)
    assert load_config(path).watches[0].path == runs.resolve()


def test_the_readme_first_command_starts_with_a_config_cloned_under_umask_002(tmp_path: Path) -> None:
    # as `git clone` writes the example config: a new file, created under the user's umask
    source, target = str(REPO / "config"), str(tmp_path / "config")
    copy = f"import shutil; shutil.copytree({source!r}, {target!r}, copy_function=shutil.copyfile)"
    subprocess.run([sys.executable, "-c", copy], preexec_fn=lambda: os.umask(0o002), check=True, timeout=60)
    config = tmp_path / "config" / "syncd.yaml"
    assert oct(os.stat(config).st_mode & 0o777) == "0o664"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    checked = subprocess.run(
        [sys.executable, "-m", "syncd", "check-config", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0 and "valid" in checked.stdout, checked.stdout + checked.stderr


def test_a_config_someone_else_can_edit_is_refused_saying_why(tmp_path: Path, runs: Path) -> None:
    daemon_group = grp.getgrnam("daemon")  # a group with a member other than root (the user `daemon`)
    assert os.geteuid() == 0 and "daemon" in _members(daemon_group.gr_gid)
    why = "whoever can edit it decides what syncd reads and overwrites as root"
    path = write_config(tmp_path, "watches:\n  - path: runs\n", mode=0o664)
    os.chown(path, 0, daemon_group.gr_gid)
    assert error_of(path) == (
        f"{path}: refusing a config writable by group daemon (mode 0664), whose members include daemon: {why}; "
        f"run: chmod g-w {path} (a group-writable config is accepted only when its group holds no one else, "
        "as a user's private group under umask 002)"
    )
    path.chmod(0o646)
    assert error_of(path) == f"{path}: refusing a config writable by others (mode 0646): {why}; run: chmod go-w {path}"
    path.chmod(0o644)
    os.chown(path, NOBODY, 0)  # a service running as root, a config its owner `nobody` may edit
    assert error_of(path) == (
        f"{path}: refusing a config owned by nobody, not by root (syncd runs as root): {why}; run: chown root {path}"
    )
    os.chown(path, 0, daemon_group.gr_gid)  # root's, group-readable only: fine
    assert load_config(path).watches[0].path == runs.resolve()


def test_check_config_user_judges_who_may_edit_the_config_as_that_user() -> None:
    """`check-config --user daemon`, run by root for a service that runs as daemon, applies the rule as the
    daemon process run as that user will: a config the user owns, or that only its private group may write,
    is accepted (both were refused for not being root's), and another user's config is refused naming it."""
    service = pwd.getpwnam("daemon")
    assert os.geteuid() == 0 and _members(service.pw_gid) == {"daemon"}, "run as root; group daemon holds only daemon"
    root = Path(tempfile.mkdtemp(prefix="syncd-config-", dir="/tmp"))  # the user can reach it, unlike tmp_path
    try:
        os.chmod(root, 0o755)
        for name in ("runs", "state"):
            (root / name).mkdir()
            os.chown(root / name, service.pw_uid, service.pw_gid)
        text = "state_dir: state\nlog:\n  path: state/sync.log.jsonl\nwatches:\n  - path: runs\n"
        path = write_config(root, text)
        os.chown(path, service.pw_uid, service.pw_gid)
        assert _checked_as(path, "daemon") == (0, f"{path}: valid (1 watch)")
        path.chmod(0o664)  # written under umask 002: its group is the user's private group
        assert _checked_as(path, "daemon") == (0, f"{path}: valid (1 watch)")
        os.chown(path, 0, service.pw_gid)  # root's, writable by a group that holds only the service's user
        assert _checked_as(path, "daemon") == (0, f"{path}: valid (1 watch)")
        path.chmod(0o644)
        os.chown(path, NOBODY, service.pw_gid)
        why = "whoever can edit it decides what syncd reads and overwrites as daemon"
        assert _checked_as(path, "daemon") == (
            2,
            f"{path}: refusing a config owned by nobody, not by daemon (the user syncd runs as) or root: {why}; "
            f"run: chown daemon {path} (or make root its owner)",
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _checked_as(path: Path, user: str) -> tuple[int, str]:
    """`syncd check-config PATH --user USER`: its exit code and output."""
    out = io.StringIO()
    code = run_check_config(path, out, user=user)
    return code, out.getvalue().strip()


def _members(gid: int) -> set[str]:
    return set(grp.getgrgid(gid).gr_mem) | {user.pw_name for user in pwd.getpwall() if user.pw_gid == gid}


def test_watching_the_root_is_refused_even_through_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "root").symlink_to("/")
    path = write_config(tmp_path, "watches:\n  - path: /\n  - path: root/\n")
    assert check_config(path) == [
        f"{path}:2: watches[0].path: refusing to watch the root directory",
        f"{path}:3: watches[1].path: refusing to watch the root directory",
    ]


def test_mirror_inside_a_watched_tree_is_refused(tmp_path: Path, runs: Path) -> None:
    (runs / "converted").mkdir()
    (tmp_path / "other").mkdir()
    path = write_config(
        tmp_path,
        """\
        watches:
          - path: runs
            output: {mirror: runs/converted}
          - path: other
            recursive: false
            output:
              mirror: runs
        """,
    )
    problems = check_config(path)
    root = tmp_path.resolve()
    assert problems == [
        f"{path}:3: watches[0].output.mirror: {root}/runs/converted overlaps its own watched tree ({root}/runs); "
        "outputs would be picked up as new sources",
        f"{path}:7: watches[1].output.mirror: {root}/runs overlaps watches[0] ({root}/runs); "
        "outputs would be picked up as new sources",
        f"{path}:7: watches[1].output.mirror: {root}/runs overlaps the mirror of watches[0] ({root}/runs/converted); "
        "two trees' outputs would take the same names",
    ]


def test_an_include_of_index_names_takes_sets(tmp_path: Path, runs: Path) -> None:
    assert check_config(write_config(tmp_path, "watches:\n  - path: runs\n    include: ['*.index.json']\n")) == []


def test_a_character_yaml_refuses_is_one_problem_not_an_internal_error(tmp_path: Path) -> None:
    path = write_config(tmp_path, "watches:\n  - path: runs\n    x: \x07\n")
    assert check_config(path) == [
        f"{path}: invalid YAML: special characters are not allowed: character #x0007 at position 31"
    ]


def test_two_watches_mirroring_into_one_place_are_refused(tmp_path: Path, runs: Path) -> None:
    """Their a.safetensors were one a.bpk, replaced by turns at every save, each line calling the other's
    output "not syncd's"."""
    (tmp_path / "other").mkdir()
    (tmp_path / "mirror").mkdir()
    path = write_config(
        tmp_path,
        "watches:\n  - path: runs\n    output: {mirror: mirror}\n  - path: other\n    output: {mirror: mirror}\n",
    )
    root = tmp_path.resolve()
    assert check_config(path) == [
        f"{path}:5: watches[1].output.mirror: {root}/mirror overlaps the mirror of watches[0] ({root}/mirror); "
        "two trees' outputs would take the same names"
    ]


def test_watch_inside_a_mirror_is_refused(tmp_path: Path, runs: Path) -> None:
    # outputs of runs/runs/x.bpk would land in mirror/runs/... = runs/... when the mirror is runs' parent
    path = write_config(tmp_path, "watches:\n  - path: runs\n    output: {mirror: .}\n")
    assert "watches[0].output.mirror:" in error_of(path)


def test_overlapping_watches_are_refused_unless_the_outer_is_not_recursive(tmp_path: Path, runs: Path) -> None:
    (runs / "exp1").mkdir()
    overlapping = write_config(tmp_path, "watches:\n  - path: runs\n  - path: runs/exp1\n")
    assert check_config(overlapping) == [
        f"{overlapping}:3: watches[1].path: overlaps watches[0] ({runs.resolve()}); "
        "a file would be handled by two watches"
    ]
    same = write_config(tmp_path, "watches:\n  - {path: runs, recursive: false}\n  - {path: ./runs/}\n")
    assert len(check_config(same)) == 1
    disjoint = write_config(tmp_path, "watches:\n  - {path: runs, recursive: false}\n  - path: runs/exp1\n")
    assert check_config(disjoint) == []


def test_modules_from_a_file(tmp_path: Path, runs: Path) -> None:
    maps = tmp_path / "maps"
    maps.mkdir()
    write_config(maps, "modules:\n  encoder.*: Linear\n  norm: RmsNorm\n", name="model.yaml")
    config = load_config(write_config(tmp_path, "watches:\n  - path: runs\n    modules: maps/model.yaml\n"))
    (watch,) = config.watches
    assert dict(watch.modules) == {"encoder.*": "Linear", "norm": "RmsNorm"}
    assert watch.modules_file == maps.resolve() / "model.yaml"


def test_modules_read_as_convert_reads_them(tmp_path: Path, runs: Path) -> None:
    """One parser for `--modules`, the config and check-config: the spellings `--modules` accepts are
    accepted inline and in a file, and a module-map file's `layout:` is kept."""
    text = "watches:\n  - path: runs\n    modules: {fc: linear, bn: BatchNorm2d}\n"
    inline = load_config(write_config(tmp_path, text))
    assert inline.watches[0].modules == {"fc": "Linear", "bn": "BatchNorm"}
    write_config(tmp_path, "layout: pytorch\nmodules:\n  fc: linear\n", name="model.yaml")
    (watch,) = load_config(write_config(tmp_path, "watches:\n  - path: runs\n    modules: model.yaml\n")).watches
    assert watch.modules == {"fc": "Linear"}
    assert watch.module_map is not None and watch.module_map.layout == "pytorch"
    only_layout = write_config(tmp_path, "layout: burn\n", name="layout.yaml")
    path = write_config(tmp_path, "watches:\n  - path: runs\n    modules: layout.yaml\n", name="other.yaml")
    (watch,) = load_config(path).watches
    assert watch.module_map is not None and watch.module_map.layout == "burn" and watch.modules == {}
    only_layout.write_text("layout: sideways\nmodules:\n  fc: Linear\n  fc: Linear\n")
    assert check_config(path) == [
        f"{only_layout.resolve()}:1: layout: expected one of pytorch, burn, got 'sideways'",
        f"{only_layout.resolve()}:4: modules['fc']: duplicate key (the earlier one would be ignored)",
    ]


def test_a_module_map_file_shared_by_watches_is_said_wrong_once(tmp_path: Path, runs: Path) -> None:
    (tmp_path / "other").mkdir()
    modules = write_config(tmp_path, "modules:\n  a: Linear\n  b: Dense\n", name="model.yaml")
    text = "watches:\n  - path: runs\n    modules: model.yaml\n  - path: other\n    modules: model.yaml\n"
    problems = check_config(write_config(tmp_path, text))
    assert len(problems) == 1 and problems[0].startswith(f"{modules.resolve()}:3: modules['b']"), problems


def test_problems_in_a_modules_file_name_that_file(tmp_path: Path, runs: Path) -> None:
    modules = write_config(tmp_path, "modules:\n  a: Linear\n  b: Dense\n", name="model.yaml")
    path = write_config(tmp_path, "watches:\n  - path: runs\n    modules: model.yaml\n    direction: up\n")
    problems = check_config(path)
    assert problems[0].startswith(f"{path}:4: watches[0].direction:")
    assert problems[1].startswith(f"{modules.resolve()}:3: modules['b']: expected a module kind")
    assert len(problems) == 2
    missing = write_config(tmp_path, "watches:\n  - path: runs\n    modules: nope.yaml\n", name="other.yaml")
    assert check_config(missing) == [
        f"{missing}:3: watches[0].modules: module map file {tmp_path.resolve()}/nope.yaml does not exist"
    ]
    (tmp_path / "maps").mkdir()
    directory = write_config(tmp_path, "watches:\n  - path: runs\n    modules: maps\n", name="dir.yaml")
    assert check_config(directory) == [
        f"{directory}:3: watches[0].modules: module map file {tmp_path.resolve()}/maps is a directory"
    ]
    write_config(tmp_path, "# nothing mapped yet\n", name="empty.yaml")  # as `convert --modules` reads it
    empty = write_config(tmp_path, "watches:\n  - path: runs\n    modules: empty.yaml\n", name="uses-empty.yaml")
    assert check_config(empty) == []
    modules.chmod(0o666)
    assert f"{modules.resolve()}: refusing a config writable by others (mode 0666)" in error_of(path)


def test_load_config_reports_the_first_problem_and_counts_the_rest(tmp_path: Path, runs: Path) -> None:
    path = write_config(tmp_path, "workers: 0\nwatches:\n  - path: runs\n    layout: x\n    poll: 1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.exit_code == 2
    assert str(caught.value) == (
        f"{path}:1: workers: expected an integer >= 1 and <= 32, got 0 "
        "(and 2 more problems; `syncd check-config` lists them)"
    )
    assert "\n" not in str(caught.value)


def test_check_config_command_prints_one_line_per_problem(tmp_path: Path, runs: Path) -> None:
    bad = write_config(tmp_path, "workers: 0\nwatches:\n  - {path: runs, layout: x}\n")
    out = io.StringIO()
    assert run_check_config(bad, out) == 2
    assert out.getvalue().splitlines() == [
        f"{bad}:1: workers: expected an integer >= 1 and <= 32, got 0",
        f"{bad}:3: watches[0].layout: expected one of auto, pytorch, burn, keep, got 'x'",
    ]
    good = write_config(tmp_path, "watches:\n  - path: runs\n", name="good.yaml")
    out = io.StringIO()
    assert run_check_config(good, out) == 0
    assert out.getvalue() == f"{good}: valid (1 watch)\n"
    out = io.StringIO()
    assert run_check_config(tmp_path / "absent.yaml", out) == 2
    assert out.getvalue().startswith(f"{tmp_path}/absent.yaml: cannot read:")


def test_log_command_can_read_a_config_whose_watches_are_gone(tmp_path: Path) -> None:
    path = write_config(tmp_path, "log: {path: x.jsonl}\nwatches:\n  - path: gone\n", mode=0o666)
    assert load_config(path, check_filesystem=False).log.path == tmp_path.resolve() / "x.jsonl"
    with pytest.raises(ConfigError):
        load_config(path)


def test_home_is_expanded(tmp_path: Path, runs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(write_config(tmp_path, "watches:\n  - path: ~/runs\n"))
    assert config.watches[0].path == runs.resolve()


def test_the_shipped_example_config_is_valid_from_a_clone() -> None:
    example = REPO / "config" / "syncd.yaml"
    assert (REPO / "config" / "runs").is_dir()
    assert not os.stat(example).st_mode & 0o002, "checked out writable by others: chmod o-w the config"
    config = load_config(example)
    assert config.watches[0].path == (REPO / "config" / "runs").resolve()
    assert config.state_dir == (REPO / "config" / "state").resolve()
    assert check_config(example) == []


def test_a_state_dir_that_is_a_file_and_a_log_path_that_is_a_directory_are_refused(tmp_path: Path, runs: Path) -> None:
    """check-config called both valid; the daemon then failed at start with `File exists` naming neither
    setting, or ran with no sync log, an error line per record."""
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    path = write_config(tmp_path, "watches:\n  - path: runs\nstate_dir: afile\n")
    assert error_of(path) == f"{path}:3: state_dir: {tmp_path}/afile exists and is not a directory"
    path = write_config(tmp_path, "watches:\n  - path: runs\nlog:\n  path: adir\n")
    assert error_of(path) == f"{path}:4: log.path: {tmp_path}/adir is a directory, not a file to log to"
    path = write_config(tmp_path, "watches:\n  - path: runs\nstate_dir: afile/sub\n")  # below a file
    assert error_of(path) == f"{path}:3: state_dir: {tmp_path}/afile exists and is not a directory"
    path = write_config(tmp_path, "watches:\n  - path: runs\nlog:\n  path: afile/log.jsonl\n")
    assert error_of(path) == f"{path}:4: log.path: {tmp_path}/afile exists and is not a directory"
