"""The architecture sweep: tiny models of many `transformers` families (most of them not in syncd's architectures
table), each saved with save_pretrained and converted to .bpk with no flags by the real CLI in a fresh process,
once with `transformers` importable there and once without it. Every tensor is checked against the layout the
type of the module owning it dictates (tests/hfsweep.py reads it from the live module tree), never against
syncd's planner. Wrong must be 0 both ways; with transformers every family converts; without it a refusal is
allowed only when it prints the module map that settles it, and that map, used, must give the right file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import REPO
from convcheck import hiding, read_bpk, read_safetensors
from hfsweep import SWEEP_TYPES, build, expected_burn, save

pytestmark = [pytest.mark.slow, pytest.mark.torch]  # builds and saves 54 models (~1.5 min)

# One interpreter runs the CLI's own `main` once per command line (as `syncd ARGS` each): a real process with
# its own imports, paying Python's and transformers' start-up once, not per model.
DRIVER = """
import json, sys
from syncd.cli import main
for argv in json.loads(sys.argv[1]):
    main(argv)
    sys.stdout.flush()
"""

Expected = dict[str, tuple[tuple[int, ...], bytes]]


@dataclass
class Counts:
    converted: list[str] = field(default_factory=list)
    refused_with_map: list[str] = field(default_factory=list)
    wrong: dict[str, list[str]] = field(default_factory=dict)
    refused_without_map: dict[str, str] = field(default_factory=dict)
    without_definition: list[str] = field(default_factory=list)  # converted, the model's definition unused

    def line(self, label: str) -> str:
        return (
            f"{label}: {len(self.converted)} converted with no flags, {len(self.refused_with_map)} refused with "
            f"the map that settles them ({', '.join(self.refused_with_map) or 'none'}), {len(self.wrong)} wrong"
        )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Expected]]:
    """Every family built once, saved with save_pretrained, with the Burn tensors its module tree dictates."""
    root = tmp_path_factory.mktemp("sweep")
    found = {}
    for seed, model_type in enumerate(SWEEP_TYPES):
        model = build(model_type, seed)
        source = save(model, root / model_type)
        tensors = {name: (t.shape, t.data) for name, t in read_safetensors(source).tensors.items()}
        found[model_type] = (source, expected_burn(model, tensors))
    return found


def run_all(commands: list[list[str]], hide: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """Run every `syncd ARGS` of `commands` in one fresh interpreter that cannot import the `hide` packages."""
    path = [str(REPO), *([hiding(hide)] if hide else [])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    env.pop("SYNCD_DEBUG", None)
    argv = [sys.executable, "-c", DRIVER, json.dumps(commands)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)


def convert_all(jobs: list[tuple[Path, Path, Path | None]], hide: tuple[str, ...]) -> list[dict]:
    """`syncd convert SOURCE -o DEST --json -v [--modules MAP]` for every job; their JSON results."""
    commands = [
        ["convert", str(source), "-o", str(dest), "--json", "-v", *(["--modules", str(map_)] if map_ else [])]
        for source, dest, map_ in jobs
    ]
    done = run_all(commands, hide)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(jobs), done.stderr[-2000:]
    return results


def wrong_tensors(dest: Path, expected: Expected) -> list[str]:
    found = {name: (t.shape, t.data) for name, t in read_bpk(dest).tensors.items()}
    return sorted(name for name in set(found) | set(expected) if found.get(name) != expected.get(name))


def settling_map(details: str) -> str | None:
    """The module-map YAML a refusal printed (its last lines, from the '# module map' comment on)."""
    start = details.find("# module map")
    return details[start:] if start >= 0 and "\nmodules:" in details[start:] else None


def sweep(saved: dict[str, tuple[Path, Expected]], out: Path, hide: tuple[str, ...]) -> Counts:
    out.mkdir()
    counts = Counts()
    jobs = [(source, out / f"{name}.bpk", None) for name, (source, _) in saved.items()]
    retries = []
    for (name, (_, expected)), result in zip(saved.items(), convert_all(jobs, hide), strict=True):
        if result["status"] == "error":
            found = settling_map(result.get("details", ""))
            if found is None:
                counts.refused_without_map[name] = result["error"]
                continue
            (out / f"{name}.yaml").write_text(found)
            retries.append(name)
            continue
        wrong = wrong_tensors(out / f"{name}.bpk", expected)
        counts.converted.append(name) if not wrong else counts.wrong.setdefault(name, wrong)
        if not any(line.startswith("module types from the model definition") for line in result["decisions"]):
            counts.without_definition.append(name)
    # a refusal counts as one only if the map it printed, used as printed, gives the right file
    jobs = [(saved[name][0], out / f"{name}.mapped.bpk", out / f"{name}.yaml") for name in retries]
    for name, result in zip(retries, convert_all(jobs, hide) if jobs else [], strict=True):
        if result["status"] == "error":
            counts.refused_without_map[name] = f"with the printed map: {result['error']}"
            continue
        wrong = wrong_tensors(out / f"{name}.mapped.bpk", saved[name][1])
        counts.refused_with_map.append(name) if not wrong else counts.wrong.setdefault(name, wrong)
    return counts


def test_the_sweep_covers_forty_families(saved: dict[str, tuple[Path, Expected]]) -> None:
    assert len(saved) >= 40
    configs = {json.loads((source.parent / "config.json").read_text())["model_type"] for source, _ in saved.values()}
    assert len(configs) == len(saved)  # distinct model types, as config.json names them


def test_with_transformers_every_family_converts_with_no_flags_and_none_is_wrong(
    saved: dict[str, tuple[Path, Expected]], tmp_path: Path
) -> None:
    counts = sweep(saved, tmp_path / "with", hide=())
    print(counts.line("with transformers"))
    assert counts.wrong == {}
    assert counts.refused_with_map == [] and counts.refused_without_map == {}
    assert len(counts.converted) == len(saved)
    assert counts.without_definition == []  # every family's own definition decided its module kinds


def test_without_transformers_none_is_wrong_and_each_refusal_prints_the_map_that_settles_it(
    saved: dict[str, tuple[Path, Expected]], tmp_path: Path
) -> None:
    counts = sweep(saved, tmp_path / "without", hide=("transformers",))
    print(counts.line("without transformers"))
    assert counts.wrong == {}
    assert counts.refused_without_map == {}
    assert len(counts.converted) + len(counts.refused_with_map) == len(saved)


def test_the_maps_syncd_modules_writes_give_a_daemon_without_transformers_the_same_files(
    saved: dict[str, tuple[Path, Expected]], tmp_path: Path
) -> None:
    """`syncd modules DIR -o MAP` where transformers is installed; then, without it, every family converts with
    that map and no other flag, and every tensor is as its module type dictates."""
    maps = {name: tmp_path / f"{name}.yaml" for name in saved}
    done = run_all([["modules", str(source.parent), "-o", str(maps[name])] for name, (source, _) in saved.items()], ())
    assert all(path.exists() for path in maps.values()), done.stdout + done.stderr[-2000:]
    jobs = [(source, tmp_path / f"{name}.bpk", maps[name]) for name, (source, _) in saved.items()]
    results = convert_all(jobs, hide=("transformers",))
    refused = {name: r["error"] for name, r in zip(saved, results, strict=True) if r["status"] == "error"}
    assert refused == {}
    wrong = {
        name: found
        for name, (source, expected) in saved.items()
        if (found := wrong_tensors(tmp_path / f"{name}.bpk", expected))
    }
    assert wrong == {}
