"""The command line as a user meets it: usage, --version, errors (plain and --json), format sniffing, -o
against --to, refusals with their module map, `syncd log` filters and rendering, closed pipes, completion,
and the progress bar on a real pseudo-terminal."""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import MNIST_BPK, MNIST_ST
from convcheck import assert_one_line_error, cli_env, dir_listing, run_cli
from daemonutil import wait_until
from safetensors.torch import save_file

from syncd.daemon.synclog import SyncLog
from syncd.engine.publish import is_scratch_name
from syncd.formats.burnpack import MAGIC

pytestmark = pytest.mark.torch


def _ambiguous(path: Path) -> Path:
    """A square bias-free 2-D weight: Linear or Embedding? The tensors alone do not say."""
    save_file({"table.weight": torch.zeros(3, 3), "fc.weight": torch.zeros(4, 2), "fc.bias": torch.zeros(4)}, path)
    return path


# ---------------------------------------------------------------------------------------------- usage


def test_no_arguments_prints_usage_and_the_commands() -> None:
    proc = run_cli()
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: syncd")
    for command in ("convert", "inspect", "run", "status", "log", "check-config", "completion"):
        assert command in proc.stderr
    assert "syncd: syncd:" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_missing_argument_names_the_command_once() -> None:
    line = assert_one_line_error(run_cli("convert"), 2, "convert: the following arguments are required: source")
    assert line.startswith("syncd: convert:") and "syncd: syncd" not in line
    assert "syncd convert --help" in line


def test_version() -> None:
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == "syncd 0.1.0"


# ---------------------------------------------------------------------------------------------- sniffing


def _torch_pt(path: Path) -> Path:
    torch.save({"w": torch.zeros(2, 2)}, path)
    return path


@pytest.mark.parametrize(
    "name, make, looks",
    [
        ("README.md", lambda p: p.write_text("# syncd\n\nKeeps checkpoints in sync.\n"), "text"),
        ("model.safetensors", lambda p: p.write_text("# not really\nplain text\n"), "text"),
        # (a `*.safetensors.index.json` is a sharded set's index, which convert reads: see test_sets.py)
        ("config.json", lambda p: p.write_text('{"hidden_size": 32, "num_hidden_layers": 2}\n'), "JSON text"),
        ("model.bpk", _torch_pt, "a zip archive"),  # under the name of a format syncd writes, never read as one
        ("model.safetensors", _torch_pt, "a zip archive"),
    ],
)
@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_a_file_of_another_kind_is_named_for_what_it_is_not(tmp_path: Path, command: str, name, make, looks) -> None:
    source = tmp_path / name
    make(source)
    line = assert_one_line_error(run_cli(command, source), 1, str(source), "not a safetensors or burnpack file")
    assert f"(looks like {looks}" in line
    assert dir_listing(tmp_path) == [name]


# ---------------------------------------------------------------------------------------------- -o and --to


def test_the_output_extension_decides_the_format(tmp_path: Path) -> None:
    source = shutil.copy(MNIST_BPK, tmp_path / "x.bpk")
    proc = run_cli("convert", source, "-o", tmp_path / "y.bpk")
    assert proc.returncode == 0, proc.stderr
    assert int.from_bytes((tmp_path / "y.bpk").read_bytes()[:4], "little") == MAGIC  # burnpack bytes in a .bpk
    st = run_cli("convert", MNIST_ST, "-o", tmp_path / "z.safetensors", "--layout", "keep")
    assert st.returncode == 0, st.stderr
    assert (tmp_path / "z.safetensors").read_bytes()[8:9] == b"{"


def test_convert_follows_a_symlink_named_on_the_command_line(tmp_path: Path) -> None:
    # a link to the latest checkpoint is how many training scripts name it; the check that the source was not
    # replaced while it was read must look the path up as it was opened (following the link)
    link = tmp_path / "latest" / MNIST_ST.name  # the same name: the outputs record it
    link.parent.mkdir()
    link.symlink_to(MNIST_ST)
    through_link = run_cli("convert", link, "-o", tmp_path / "a.bpk")
    assert through_link.returncode == 0, through_link.stderr
    direct = run_cli("convert", MNIST_ST, "-o", tmp_path / "b.bpk")
    assert direct.returncode == 0, direct.stderr
    assert (tmp_path / "a.bpk").read_bytes() == (tmp_path / "b.bpk").read_bytes()


@pytest.mark.parametrize("to, output", [("safetensors", "y.bpk"), ("bpk", "y.safetensors")])
def test_an_output_extension_contradicting_to_is_refused(tmp_path: Path, to: str, output: str) -> None:
    source = shutil.copy(MNIST_BPK, tmp_path / "x.bpk")
    assert_one_line_error(run_cli("convert", source, "--to", to, "-o", tmp_path / output), 2, "contradicts", output)
    assert dir_listing(tmp_path) == ["x.bpk"]


# ---------------------------------------------------------------------------------------------- refusals, --json


def test_a_refusal_prints_its_module_map_without_verbose(tmp_path: Path) -> None:
    source = _ambiguous(tmp_path / "amb.safetensors")
    proc = run_cli("convert", source)
    assert proc.returncode == 1 and proc.stdout == ""
    first, *rest = proc.stderr.splitlines()
    assert first.startswith(f"syncd: {source}: ") and "table" in first
    assert yaml.safe_load("\n".join(rest))["modules"] == {"**.table": "Embedding"}
    verbose = run_cli("convert", source, "-v").stderr  # -v adds the per-module reasons
    assert "2-D weight [3, 3] without bias" in verbose and "2-D weight" not in proc.stderr


def test_json_errors_are_json(tmp_path: Path) -> None:
    missing = tmp_path / "missing.bpk"
    proc = run_cli("convert", missing, "--json")
    assert proc.returncode == 1 and proc.stderr == ""
    doc = json.loads(proc.stdout)
    assert doc["status"] == "error" and doc["exit_code"] == 1 and str(missing) in doc["error"]

    usage = run_cli("convert", "--json", "--to", "tar")
    assert usage.returncode == 2 and usage.stderr == ""
    assert "--to" in json.loads(usage.stdout)["error"]

    refused = run_cli("convert", _ambiguous(tmp_path / "amb.safetensors"), "--json")
    doc = json.loads(refused.stdout)
    assert refused.returncode == 1 and doc["exit_code"] == 1 and "modules:" in doc["details"]

    assert json.loads(run_cli("inspect", tmp_path / "nope.safetensors", "--json").stdout)["status"] == "error"
    log = run_cli("log", "--file", tmp_path / "no.log", "--json")
    assert log.returncode == 1 and "no sync log yet" in json.loads(log.stdout)["error"]


# ---------------------------------------------------------------------------------------------- syncd log


def _sample_log(path: Path) -> Path:
    watch = "/srv/checkpoints/exp1"
    with SyncLog(path) as log:
        log.log(
            "converted",
            watch=watch,
            source=f"{watch}/run/ckpt-100.bpk",
            dest=f"{watch}/run/ckpt-100.safetensors",
            tensors=18,
            bytes=1045032,
            duration_ms=31.5,
        )
        log.log(
            "refused",
            watch=watch,
            source=f"{watch}/run/amb.safetensors",
            dest=f"{watch}/run/amb.bpk",
            error="amb.safetensors: cannot convert to burn layout: the tensors do not decide what emb is",
            reason='module map that would settle it:\nmodules:\n  "emb": Embedding  # or Linear',
        )
        log.log("converted", watch=watch, source=f"{watch}/a.bpk", dest="/mirror/exp1/a.safetensors")
    return path


def test_log_rejects_an_unknown_status(tmp_path: Path) -> None:
    log = _sample_log(tmp_path / "sync.log.jsonl")
    assert_one_line_error(run_cli("log", "--file", log, "--status", "bogus"), 2, "unknown status bogus")
    assert_one_line_error(run_cli("log", "--file", log, "--status", "refused,nope"), 2, "nope")
    assert run_cli("log", "--file", log, "--status", "refused").returncode == 0


def test_log_table_shows_errors_module_maps_and_short_paths(tmp_path: Path) -> None:
    proc = run_cli("log", "--file", _sample_log(tmp_path / "sync.log.jsonl"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "\\n" not in proc.stdout
    refused = next(line for line in lines if " refused " in line)
    assert "run/amb.safetensors -> run/amb.bpk" in refused
    assert "cannot convert to burn layout" in refused and "module map that would settle it:" in refused
    follow = lines[lines.index(refused) + 1 :]
    assert follow[0].strip() == "modules:" and follow[1].strip() == '"emb": Embedding  # or Linear'
    assert any("run/ckpt-100.bpk -> run/ckpt-100.safetensors" in line for line in lines)
    assert lines[1] == "watch /srv/checkpoints/exp1:"  # named once, above the rows relative to it
    assert "/srv/checkpoints" not in "\n".join(lines[2:])
    assert any("a.bpk -> /mirror/exp1/a.safetensors" in line for line in lines)  # outside the watch: as logged


@pytest.mark.parametrize(
    "args",
    [("log", "--file", "{log}"), ("log", "--file", "{log}", "--json"), ("inspect", str(MNIST_BPK))],
    ids=["log", "log-json", "inspect"],
)
def test_a_closed_pipe_is_not_an_error(tmp_path: Path, args: tuple[str, ...]) -> None:
    log = tmp_path / "sync.log.jsonl"
    with SyncLog(log) as sync_log:
        for n in range(5000):
            sync_log.log("converted", watch="/w", source=f"/w/{n}.bpk", dest=f"/w/{n}.safetensors", bytes=n)
    command = [sys.executable, "-m", "syncd", *(arg.format(log=log) for arg in args)]
    proc = subprocess.run(
        f"{' '.join(map(str, command))} | head -1",
        shell=True,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout.count("\n") == 1
    assert proc.stderr == "", proc.stderr


# ---------------------------------------------------------------------------------------------- completion


def _complete(script: str, *words: str) -> list[str]:
    words_text = " ".join(f"'{word}'" for word in words)
    call = f"COMP_WORDS=({words_text}); COMP_CWORD={len(words) - 1}; _syncd"
    program = f"{script}\n{call}; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    proc = subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_bash_completion_comes_from_the_parser(tmp_path: Path) -> None:
    proc = run_cli("completion", "bash")
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    assert subprocess.run(["bash", "-n"], input=script, text=True, timeout=60).returncode == 0
    assert _complete(script, "syncd", "c") == ["convert", "check-config", "completion"]
    assert _complete(script, "syncd", "convert", "x.bpk", "--to", "") == ["bpk", "safetensors"]
    assert set(_complete(script, "syncd", "convert", "x.bpk", "--l")) == {"--layout"}
    assert "--quiet" in _complete(script, "syncd", "convert", "x.bpk", "--")
    assert _complete(script, "syncd", "log", "--s") == ["--status", "--since"]
    assert _complete(script, "syncd", "completion", "") == ["bash"]


# ---------------------------------------------------------------------------------------------- progress


def _run_on_a_terminal(args: list[str], cwd: Path) -> tuple[int, str]:
    """`syncd ARGS` with stdout and stderr on a pseudo-terminal; returns (status, everything it showed)."""
    main, terminal = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncd", *args],
        cwd=cwd,
        env=cli_env(),
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
    )
    os.close(terminal)
    shown = bytearray()
    while True:
        ready, _, _ = select.select([main], [], [], 120)
        if not ready:
            proc.kill()
            raise AssertionError(f"no output for 120 s; so far: {bytes(shown)!r}")
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: every writer of the terminal is gone
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    return proc.wait(60), shown.decode("utf-8", errors="replace")


def _large_checkpoint(path: Path) -> Path:
    # enough bytes for the bar to be drawn more than once: 64 tensors of 1 MiB, Linear-shaped
    save_file({f"l{n}.weight": torch.ones(512, 512) * n for n in range(64)} | {"l0.bias": torch.zeros(512)}, path)
    return path


def test_convert_draws_a_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    source = _large_checkpoint(tmp_path / "big.safetensors")
    status, shown = _run_on_a_terminal(["convert", str(source), "--layout", "keep"], tmp_path)
    assert status == 0, shown
    assert "big.safetensors 100% [" in shown and "ETA" in shown and "B/s  ETA" in shown and "/ 64.0 MiB" in shown
    assert shown.rstrip().split("\n")[-1].split("\r\x1b[K")[-1].startswith("converted: ")  # the bar is erased

    quiet_status, quiet = _run_on_a_terminal(
        ["convert", str(source), "-o", "q.bpk", "--layout", "keep", "-q"], tmp_path
    )
    assert quiet_status == 0 and "%" not in quiet and "ETA" not in quiet and quiet.startswith("converted: ")


def test_no_progress_bar_when_not_a_terminal(tmp_path: Path) -> None:
    source = _large_checkpoint(tmp_path / "big.safetensors")
    proc = run_cli("convert", source, "--layout", "keep")
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith("converted: ") and "ETA" not in proc.stdout


def test_many_carried_tensors_are_counted_and_listed_with_verbose(tmp_path: Path) -> None:
    """A ResNet has one num_batches_tracked per BatchNorm: one line counts them, -v lists each."""
    norms = torch.nn.Sequential(*[torch.nn.BatchNorm1d(2) for _ in range(5)])
    save_file(norms.state_dict(), tmp_path / "norms.safetensors")
    quiet = run_cli("convert", tmp_path / "norms.safetensors")
    carried = [line for line in quiet.stdout.splitlines() if "carried in metadata" in line]
    assert carried == [
        "  carried in metadata (no slot on the target side): 5 tensors, e.g. 0.num_batches_tracked (-v lists them)"
    ]
    verbose = run_cli("convert", tmp_path / "norms.safetensors", "-o", tmp_path / "v.bpk", "-v")
    listed = [line for line in verbose.stdout.splitlines() if "carried in metadata" in line]
    assert listed == [f"  carried in metadata (no slot on the target side): {i}.num_batches_tracked" for i in range(5)]


def has_bytes(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except FileNotFoundError:
        return False  # published (or removed) since it was listed


def converting_in_the_background(tmp_path: Path) -> tuple[Path, subprocess.Popen[str], str]:
    """`syncd convert` of a 384 MiB checkpoint, returned once its scratch file is there (it is writing the
    output): the source, the process and the scratch file's name."""
    source = tmp_path / "big.safetensors"
    save_file({"fc.weight": torch.zeros(12288, 8192), "fc.bias": torch.zeros(12288)}, source)
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncd", "convert", os.fspath(source), "-q"],
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def writing() -> list[str]:
        """The scratch file once it holds bytes: an empty one may not be locked yet, and a conversion killed
        then leaves one the next conversion keeps for SCRATCH_GRACE_SECONDS (its writer may be alive)."""
        assert proc.poll() is None, proc.communicate()  # done (or failed) before anything could be sent
        return [name for name in os.listdir(tmp_path) if is_scratch_name(name) and has_bytes(tmp_path / name)]

    (scratch,) = wait_until(writing, 60, "the scratch file")
    return source, proc, scratch


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_conversion_stopped_by_a_signal_leaves_no_scratch_file(tmp_path: Path, sig: int, code: int) -> None:
    """kill, a job's time limit or a container stopping sends SIGTERM: the scratch file (as large as the output)
    goes, as on Ctrl-C. The process is held (SIGSTOP) while its scratch file is checked, so the signal lands in
    the middle of the conversion: sent after the check alone, it could land once the conversion was done, as
    the process exited (a CI run saw it die of SIGINT, -2)."""
    for _ in range(3):
        _, proc, scratch = converting_in_the_background(tmp_path)
        proc.send_signal(signal.SIGSTOP)
        if scratch in os.listdir(tmp_path):
            break
        proc.send_signal(signal.SIGCONT)  # done before it was held: again
        proc.communicate(timeout=60)
        for name in os.listdir(tmp_path):
            os.unlink(tmp_path / name)
    else:
        pytest.fail("each conversion ended before it could be held")
    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr
    assert dir_listing(tmp_path) == ["big.safetensors"]


def test_the_scratch_file_of_a_conversion_killed_outright_goes_at_the_next_conversion_to_that_file(
    tmp_path: Path,
) -> None:
    """SIGKILL (the OOM killer, kill -9) leaves the scratch file: nothing in the process can remove it. The next
    conversion to the same destination does, since no living process holds it."""
    source, proc, left = converting_in_the_background(tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    assert left in os.listdir(tmp_path)
    assert run_cli("convert", source, "-q").returncode == 0
    assert dir_listing(tmp_path) == ["big.bpk", "big.safetensors"]
