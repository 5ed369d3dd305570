"""What a new user meets around the commands: help that lists the exit statuses and says what each argument
is, an output name the tool cannot honour refused, `inspect DIR` of a sharded set like `convert DIR`,
completion of `log --status`, and `syncd retry` saying what it did, what it does not know and what it needs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from conftest import MNIST_BPK
from convcheck import assert_one_line_error, cli_env, run_cli
from daemonutil import NOBODY, as_nobody
from safetensors.torch import save_file

from syncd.daemon.state import StateDB
from syncd.daemon.statuses import STATUSES
from syncd.formats.fileio import FileStamp

pytestmark = pytest.mark.torch


def _config(root: Path) -> Path:
    (root / "runs").mkdir(parents=True)
    config = root / "syncd.yaml"
    config.write_text(yaml.safe_dump({"state_dir": "state", "watches": [{"path": "runs"}]}))
    config.chmod(0o644)
    return config


def _as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
    """`syncd ARGS` run as the user nobody (the suite runs as root), from this checkout."""
    return as_nobody([sys.executable, "-m", "syncd", *args], cli_env())


def _failed(root: Path, name: str) -> Path:
    """A source the state database remembers as failed (as a refused conversion leaves it)."""
    source = root / "runs" / name
    source.write_bytes(b"not a checkpoint")
    with StateDB(root / "state") as state:
        state.record_failure(source, FileStamp.of_path(source), "refused: not a checkpoint", transient=False)
    return source


def test_help_lists_the_exit_statuses() -> None:
    for args in (("--help",), ("convert", "--help"), ("retry", "--help")):
        shown = run_cli(*args)
        assert shown.returncode == 0, shown.stderr
        assert "exit status:" in shown.stdout
        for code in ("0 ", "1 ", "2 ", "3 "):
            assert f"\n  {code}" in shown.stdout, shown.stdout
    daemon = run_cli("run", "--help").stdout  # the daemon's own: it ends 0 on SIGTERM and Ctrl-C, never 130/143
    statuses = daemon.split("exit status:")[1]
    assert "\n  0    stopped by SIGTERM" in statuses and "\n  2 " in statuses and "130" not in statuses


def test_every_argument_of_run_and_convert_says_what_it_is() -> None:
    run = run_cli("run", "--help").stdout
    assert "-c CONFIG, --config CONFIG\n" in run and "YAML configuration" in run
    convert = run_cli("convert", "--help").stdout
    source_help = convert.split("positional arguments:")[1].split("options:")[0]
    assert "source" in source_help and "checkpoint to convert" in source_help


def test_an_output_name_without_a_format_suffix_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "x.txt"
    assert_one_line_error(run_cli("convert", MNIST_BPK, "-o", out), 2, "x.txt", "unknown output suffix", ".bpk")
    assert not out.exists()
    assert run_cli("convert", MNIST_BPK, "-o", tmp_path).returncode == 0  # a directory still takes the default name
    assert (tmp_path / "mnist_web.safetensors").exists()
    # a name ending in / is a directory, which must exist (it was written as a file of that name)
    missing = f"{tmp_path}/new/"
    assert_one_line_error(run_cli("convert", MNIST_BPK, "-o", missing), 2, missing, "no such directory")
    assert not (tmp_path / "new").exists()
    assert_one_line_error(run_cli("convert", MNIST_BPK, "-o", f"{tmp_path}/new/."), 2, "no such directory")
    (tmp_path / "new").mkdir()
    assert run_cli("convert", MNIST_BPK, "-o", missing).returncode == 0
    assert (tmp_path / "new" / "mnist_web.safetensors").exists()


def test_inspect_of_a_sharded_sets_directory_describes_the_set(tmp_path: Path) -> None:
    directory = tmp_path / "set"
    directory.mkdir()
    save_file({"a.weight": torch.zeros(2, 3)}, directory / "model-00001-of-00002.safetensors")
    save_file({"b.weight": torch.ones(4)}, directory / "model-00002-of-00002.safetensors")
    index = {
        "metadata": {"total_size": 40},
        "weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"},
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    shown = run_cli("inspect", directory, "--json")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert {t["name"]: t["shard"] for t in doc["tensors"]} == index["weight_map"]
    converted = run_cli("convert", directory, "-o", tmp_path / "set.bpk", "--layout", "keep")  # as convert reads it
    assert converted.returncode == 0, converted.stderr


def test_log_status_completes_the_statuses(tmp_path: Path) -> None:
    script = run_cli("completion", "bash").stdout
    line = "syncd log --status "
    probe = (
        f"{script}\nCOMP_WORDS=(syncd log --status ''); COMP_CWORD=3; cd {tmp_path}; _syncd; "
        'printf "%s\\n" "${COMPREPLY[@]}"'
    )
    (tmp_path / "a-file-name").touch()
    offered = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=60).stdout.split()
    assert sorted(offered) == sorted(STATUSES), (line, offered)


def test_retry_without_paths_is_one_usage_line(tmp_path: Path) -> None:
    config = _config(tmp_path)
    line = assert_one_line_error(run_cli("retry", "-c", config), 2, "give the PATHs", "--all-failed")
    assert line.startswith("syncd: retry: ") and "syncd: syncd" not in line
    both = assert_one_line_error(run_cli("retry", "-c", config, "--all-failed", tmp_path / "x"), 2, "not both")
    assert both.startswith("syncd: retry: give PATHs or --all-failed")


def test_retry_of_a_file_the_daemon_does_not_know_says_so(tmp_path: Path) -> None:
    config = _config(tmp_path)
    failed = _failed(tmp_path, "bad.safetensors")
    unknown = tmp_path / "runs" / "nonexistent.safetensors"
    proc = run_cli("retry", "-c", config, unknown)
    assert_one_line_error(proc, 1, str(unknown), "not known")
    both = run_cli("retry", "-c", config, failed, unknown)
    assert both.returncode == 1 and both.stdout.startswith("1 failed file(s) marked"), both.stdout
    assert "not known" in both.stderr and str(unknown) in both.stderr


@pytest.mark.root
def test_retry_by_someone_who_cannot_write_the_state_says_what_it_needs(tmp_path: Path) -> None:
    assert os.geteuid() == 0, "this test runs `syncd retry` as another user: run the suite as root, as CI does"
    root = Path(tempfile.mkdtemp(prefix="syncd-retry-", dir="/tmp"))
    try:
        os.chmod(root, 0o755)
        config = _config(root)
        source = _failed(root, "bad.safetensors")
        os.chmod(root / "state", 0o755)  # readable, as the service's group reads it; writable by its owner only
        os.chmod(root / "state" / "state.sqlite3", 0o644)
        proc = _as_nobody("retry", "-c", str(config), str(source))
        line = assert_one_line_error(proc, 1, "state database", "root", "sudo -u root syncd retry -c")
        assert "readonly" not in line
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.root
def test_status_by_someone_who_may_not_read_it_is_no_stopped_daemon(tmp_path: Path) -> None:
    """`syncd status` exits 1 when the daemon does not run, which a monitoring check reads as down; a caller
    who may not read the status file got that 1 too, about a daemon running fine."""
    assert os.geteuid() == 0, "this test runs `syncd status` as another user: run the suite as root, as CI does"
    root = Path(tempfile.mkdtemp(prefix="syncd-status-", dir="/tmp"))
    try:
        os.chmod(root, 0o755)
        config = _config(root)
        (root / "state").mkdir(mode=0o755)
        (root / "state" / "status.json").write_text("{}")
        os.chmod(root / "state" / "status.json", 0o640)  # the service's group reads it; others do not
        proc = _as_nobody("status", "-c", str(config))
        assert_one_line_error(proc, 2, "status.json", "permission denied", "service's group")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.root
def test_a_daemon_that_cannot_write_its_sync_log_does_not_start() -> None:
    """A sync log file the daemon's user may not write (left by a first run as root): check-config said the
    daemon cannot start, and it ran, every line of its log lost ("cannot write the sync log" per line)."""
    assert os.geteuid() == 0, "this test runs `syncd run` as another user: run the suite as root, as CI does"
    root = Path(tempfile.mkdtemp(prefix="syncd-run-", dir="/tmp"))
    try:
        os.chmod(root, 0o755)
        for usable_by_nobody in ("runs", "state"):
            (root / usable_by_nobody).mkdir()
            os.chown(root / usable_by_nobody, NOBODY, NOBODY)
        log = root / "state" / "sync.jsonl"
        log.write_text("")
        log.chmod(0o444)  # root's, as a first run as root leaves it
        config = root / "syncd.yaml"
        config.write_text(
            yaml.safe_dump({"state_dir": str(root / "state"), "log": {"path": str(log)}, "watches": [{"path": "runs"}]})
        )
        config.chmod(0o644)
        proc = _as_nobody("run", "-c", str(config))
        assert_one_line_error(proc, 2, str(config), f"log.path: cannot use {log}: Permission denied")
        checked = run_cli("check-config", str(config), "--user", "nobody")
        assert checked.returncode == 2 and "cannot write the sync log" in checked.stdout, checked.stdout
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.root
@pytest.mark.parametrize("setting", ["state_dir", "log.path"])
def test_a_daemon_that_cannot_make_its_state_or_log_names_the_setting(setting: str) -> None:
    """`syncd@alice` left with service.yaml's state_dir: /var/lib/syncd said only `.../lock: Permission denied`,
    naming neither the setting nor the configuration. It exits 2, a configuration problem, which systemd's
    RestartPreventExitStatus=2 does not restart (exit 1 was restarted every 5 seconds forever); and
    `check-config --user` refuses that config the same way (it said `valid`, exit 0, with a warning)."""
    assert os.geteuid() == 0, "this test runs `syncd run` as another user: run the suite as root, as CI does"
    root = Path(tempfile.mkdtemp(prefix="syncd-run-", dir="/tmp"))
    try:
        os.chmod(root, 0o755)  # root's: nobody may make nothing in it
        (root / "runs").mkdir()
        (root / "mine").mkdir()
        for usable_by_nobody in ("runs", "mine"):
            os.chown(root / usable_by_nobody, NOBODY, NOBODY)
        closed, usable = str(root / "closed" / "sub"), str(root / "mine" / "x")
        state, log = (closed, usable) if setting == "state_dir" else (usable, closed)
        config = root / "syncd.yaml"
        config.write_text(
            yaml.safe_dump(
                {"state_dir": state, "log": {"path": f"{log}/sync.log.jsonl"}, "watches": [{"path": "runs"}]}
            )
        )
        config.chmod(0o644)
        proc = _as_nobody("run", "-c", str(config))
        named = state if setting == "state_dir" else f"{log}/sync.log.jsonl"
        assert_one_line_error(proc, 2, str(config), f"{setting}: cannot use {named}: Permission denied")
        checked = run_cli("check-config", str(config), "--user", "nobody")
        assert (checked.returncode, checked.stdout.splitlines()) == (
            2,
            [f"{config}: user nobody cannot create {closed} ({setting}) in {root}, so the daemon cannot start"],
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
