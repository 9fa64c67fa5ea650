"""Command line: ``python -m handlers check MODEL_YAML...`` validates model YAMLs with the code the worker runs.

A mistake in the ``pt2`` or ``pt2_handlers`` section otherwise shows only in the worker's log, behind
TorchServe's generic "Failed to start workers". Every problem of a file is printed, one per line. ``scripts/package.py``
runs the same check before it builds an archive. Exit status 1 if any file is invalid.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from handlers.config import load_config_file
from handlers.errors import ConfigError


def check(paths: list[Path], import_dirs: list[Path]) -> int:
    """Print a line per file saying what it configures, or a line per problem in it; the number of invalid files."""
    sys.path[:0] = [str(d) for d in import_dirs]  # where a "module:function" backend would be at the archive root
    invalid = 0
    for path in paths:
        try:
            config = load_config_file(path)
        except ConfigError as exc:
            invalid += 1
            for problem in exc.problems:  # every one, each on its own line: one run finds them all
                print(f"{path}: INVALID: {problem}")
            continue
        settings = config.settings
        compile_text = (f"compile {config.served_compile.backend} (mode {config.served_compile.mode or 'default'})"
                        if config.compile.enabled else "compile off")
        print(f"{path}: ok: task {settings.task}, {compile_text}, ladder "
              f"{'/'.join(rung.value for rung in settings.ladder)}, shapes {settings.shapes.kind.value}, "
              f"dtype {'/'.join(d.value for d in settings.dtype)}")
        for warning in config.warnings:
            print(f"{path}: warning: {warning}")
    return invalid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m handlers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    checker = commands.add_parser("check", help="validate model YAML files (the pt2 and pt2_handlers sections)")
    checker.add_argument("paths", nargs="+", type=Path)
    checker.add_argument("--import-dir", type=Path, action="append", default=[],
                         help="a directory to import custom backends from (the files packed at the archive root)")
    args = parser.parse_args(argv)
    return 1 if check(args.paths, args.import_dir) else 0


if __name__ == "__main__":
    sys.exit(main())
