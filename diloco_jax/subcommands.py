"""Dispatch of `<program> <name> [args]` to a module's `main(argv)`: the CLI and `bench` share it."""

import importlib
import sys


def dispatch(modules: dict[str, str], argv: list[str], doc: str, what: str = "command") -> int:
  """Runs `modules[argv[1]].main([argv[0] + " " + name] + argv[2:])`; prints `doc` on -h/--help."""
  if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
    print(doc)
    return 0
  name = argv[1]
  if name not in modules:
    print(f"unknown {what} {name!r}; expected one of: {', '.join(modules)}", file=sys.stderr)
    return 2
  return importlib.import_module(modules[name]).main([f"{argv[0]} {name}"] + list(argv[2:])) or 0
