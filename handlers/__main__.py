"""Command line: ``python -m handlers COMMAND``, run from the project's root (the defaults are relative to it).

  check MODEL_YAML...          validate model YAMLs with the code the worker runs (exit 1 if any is invalid)
  package [--name ...]         build a self-contained .mar into model_store/, checking the model YAML first
  start [NAME=ARCHIVE ...]     start TorchServe with token auth on and wait until each model is READY
  stop                         stop it
  list, register, scale, describe, default, unregister, ready
                               the management API of the running server

--config and --run-dir name the server for start, stop and the management commands, before or after the command
(default: model_configs/config.properties and .run/). ``python -m handlers COMMAND --help`` says more.
"""

from __future__ import annotations

import argparse
import sys

from handlers.serving import archive, management, server


def parser() -> argparse.ArgumentParser:
    """Each command's arguments come from its module: archive (check, package), server (start, stop) and
    management (list ... ready); each sets ``run``, which takes the parsed arguments and returns the exit status."""
    top = argparse.ArgumentParser(prog="python -m handlers", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    server.add_server_options(top)
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    archive.add_commands(commands)
    server.add_commands(commands)
    management.add_commands(commands)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
