"""The commands table (`diloco_jax/commands.py`): every entry names a function that exists, the help lists
every command and subcommand without importing jax, every command's --help works, and no other module
defines a `main`."""

import ast
import json
import subprocess
import sys

import helpers
from diloco_jax import commands

PACKAGE = helpers.REPO / "diloco_jax"


def _leaves(table, prefix=()):
  """(path of names, Command) of every runnable entry, groups' subcommands included."""
  for name, entry in table.items():
    if isinstance(entry, commands.Group):
      yield from _leaves(entry.commands, prefix + (name,))
    else:
      yield prefix + (name,), entry


def _functions(module: str) -> set[str]:
  path = helpers.REPO.joinpath(*module.split(".")).with_suffix(".py")
  return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def test_every_entry_names_a_function_of_its_module():
  leaves = list(_leaves(commands.COMMANDS))
  assert len(leaves) >= 28
  for path, entry in leaves:
    module, function = entry.target.split(":")
    assert function in _functions(module), (path, entry.target)
    assert entry.help and "\n" not in entry.help, path


def test_no_module_but_the_table_defines_main():
  found = [str(p.relative_to(helpers.REPO)) for p in PACKAGE.rglob("*.py")
           if "main" in {n.name for n in ast.parse(p.read_text()).body if isinstance(n, ast.FunctionDef)}]
  assert found == ["diloco_jax/commands.py"], found


def test_help_lists_every_command_and_subcommand_without_jax():
  code = ("import contextlib, io, json, sys\n"
          "from diloco_jax import commands\n"
          "out = {}\n"
          "for args in ([], ['--help'], ['bench', '--help'], ['sim', '-h']):\n"
          "  buf = io.StringIO()\n"
          "  with contextlib.redirect_stdout(buf):\n"
          "    rc = commands.main(['python -m diloco_jax', *args])\n"
          "  out[' '.join(args)] = [rc, buf.getvalue()]\n"
          "print(json.dumps({'jax': 'jax' in sys.modules, 'out': out}))\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=helpers.REPO, capture_output=True, text=True, timeout=120)
  result = json.loads(proc.stdout)
  assert not result["jax"], "the table's help imported jax"
  rc, top = result["out"]["--help"]
  assert rc == 0 and top.startswith("usage: python -m diloco_jax <command> [flags]")
  assert result["out"][""] == result["out"]["--help"]
  lines = top.splitlines()
  for path, entry in _leaves(commands.COMMANDS):
    assert any(line.split()[:1] == [path[-1]] and line.endswith(entry.help) for line in lines), path
  for group, what in (("bench", "benchmark"), ("sim", "simulator")):
    rc, text = result["out"][f"{group} --help" if group == "bench" else f"{group} -h"]
    assert rc == 0 and text.startswith(f"usage: python -m diloco_jax {group} <{what}> [flags]")
    assert all(entry.help in text for entry in commands.COMMANDS[group].commands.values())


def test_python_m_help_and_an_unknown_command():
  ok = subprocess.run([sys.executable, "-m", "diloco_jax", "--help"], cwd=helpers.REPO, capture_output=True,
                      text=True, timeout=120)
  assert ok.returncode == 0 and "bench" in ok.stdout and "sizes" in ok.stdout
  for args, what in ((["nope"], "command"), (["bench", "nope"], "benchmark"), (["sim", "nope"], "simulator")):
    bad = subprocess.run([sys.executable, "-m", "diloco_jax", *args], cwd=helpers.REPO, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and f"unknown {what} 'nope'" in bad.stderr, bad.stderr


def test_every_command_help_exits_0_and_names_the_command():
  """One interpreter runs every command's --help (the imports are shared)."""
  code = ("import contextlib, io, json, sys\n"
          "from diloco_jax import commands\n"
          "out = {}\n"
          "for path in json.loads(sys.argv[1]):\n"
          "  buf = io.StringIO()\n"
          "  try:\n"
          "    with contextlib.redirect_stdout(buf):\n"
          "      rc = commands.main(['python -m diloco_jax', *path, '--help'])\n"
          "  except SystemExit as e:\n"
          "    rc = e.code\n"
          "  out[' '.join(path)] = [rc, buf.getvalue().split(chr(10))[0]]\n"
          "print(json.dumps(out))\n")
  paths = [list(path) for path, _ in _leaves(commands.COMMANDS)]
  proc = subprocess.run([sys.executable, "-c", code, json.dumps(paths)], cwd=helpers.REPO, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  for name, (rc, first) in out.items():
    assert rc == 0 and first == f"usage: python -m diloco_jax {name} [flags]", (name, rc, first)
