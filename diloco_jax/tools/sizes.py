"""`python -m diloco_jax sizes`: the package's largest module, class and function, and every one over the
size targets (modules 400 lines, classes 300, functions 60; generated protobuf excluded).

  python -m diloco_jax sizes [--root DIR]

Lines are counted as written (a module: all its lines; a class or function: from its `def`/`class` line to
its last line, docstring and comments included). Always exits 0: the targets are enforced by a test.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

from absl import flags

from diloco_jax import cli

PACKAGE = pathlib.Path(__file__).resolve().parents[1]
TARGETS = {"module": 400, "class": 300, "function": 60}
GENERATED = ("_pb2.py", "_pb2_grpc.py")


@dataclasses.dataclass(frozen=True, order=True)
class Size:
  """One module, class or function: its lines, and where it is (`path` or `path:Name`)."""

  lines: int
  where: str
  kind: str


def measure(root: str | pathlib.Path = PACKAGE) -> list[Size]:
  """Every module, class and function under `root` (generated protobuf excluded), largest first."""
  root = pathlib.Path(root)
  sizes = []
  for path in sorted(root.rglob("*.py")):
    if path.name.endswith(GENERATED):
      continue
    text = path.read_text()
    name = str(path.relative_to(root.parent))
    sizes.append(Size(len(text.splitlines()), name, "module"))
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        sizes.append(Size(node.end_lineno - node.lineno + 1, f"{name}:{node.name}", kind))
  return sorted(sizes, reverse=True)


def over_targets(sizes: list[Size]) -> list[Size]:
  """The sizes over their kind's target, largest first."""
  return [s for s in sizes if s.lines > TARGETS[s.kind]]


def format_sizes(sizes: list[Size]) -> str:
  """The largest of each kind, then every one over its target (or a line saying none is)."""
  lines = []
  for kind, target in TARGETS.items():
    largest = next((s for s in sizes if s.kind == kind), None)
    if largest is not None:
      lines.append(f"largest {kind}: {largest.lines} lines  {largest.where}  (target {target})")
  over = over_targets(sizes)
  lines.append(f"over the targets: {len(over)}" if over else "over the targets: none")
  lines.extend(f"  {s.lines:5d}  {s.kind:<8}  {s.where}  (target {TARGETS[s.kind]})" for s in over)
  return "\n".join(lines)


def _define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("root", str(PACKAGE), "the package directory to measure", flag_values=fv)


def print_sizes(argv) -> int:
  """`python -m diloco_jax sizes [--root DIR]`; see the module docstring."""
  fv = cli.parse(argv, _define_flags, doc=__doc__, config=False)
  root = pathlib.Path(fv.root)
  if not root.is_dir():
    raise cli.UsageError(f"--root {fv.root!r} is not a directory")
  print(format_sizes(measure(root)))
  return 0
