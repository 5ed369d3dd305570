"""Run syncd's command line from a given copy of the source tree instead of the installed package.

    python bench/syncd_at.py SRC_ROOT convert A -o B      # as `syncd convert A -o B`, importing SRC_ROOT/syncd
    python bench/syncd_at.py SRC_ROOT --where              # imports syncd.engine.convert, prints syncd's path
    python bench/syncd_at.py SRC_ROOT --import MODULE      # exit 0 if MODULE imports from SRC_ROOT

`bench/run.py --snapshot` uses it to measure syncd as committed at HEAD (a `git archive` under bench/work/)
while others keep editing the working tree. The venv's editable install puts a finder on sys.meta_path that
wins over sys.path, so it is removed first; everything else (numpy, safetensors, ...) comes from the venv.
"""

from __future__ import annotations

import sys


def main() -> int:
    root = sys.argv[1]
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    sys.path.insert(0, root)
    if sys.argv[2:] == ["--where"]:  # also the import cost of a conversion, for run.py's startup figure
        import syncd
        import syncd.cli
        import syncd.engine.convert

        print(syncd.__file__)
        return 0
    if len(sys.argv) == 4 and sys.argv[2] == "--import":  # can this copy import a module? (run.py's probes)
        import importlib

        importlib.import_module(sys.argv[3])
        return 0
    from syncd.cli import main as syncd_main

    sys.argv = ["syncd", *sys.argv[2:]]
    return syncd_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
