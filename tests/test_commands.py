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


def test_every_command_help_is_its_own_and_loads_no_jax():
  """One interpreter runs every command's --help: exit 0, the command's usage line and its own flags; the
  commands whose modules load jax (`Command.flags`) first; no command's help imports jax."""
  leaves = sorted(_leaves(commands.COMMANDS), key=lambda leaf: not leaf[1].flags)  # the light help first
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
          "  out[' '.join(path)] = [rc, buf.getvalue(), 'jax' in sys.modules]\n"
          "print(json.dumps(out))\n")
  proc = subprocess.run([sys.executable, "-c", code, json.dumps([list(path) for path, _ in leaves])],
                        cwd=helpers.REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  for path, entry in leaves:
    name = " ".join(path)
    rc, text, jax_loaded = out[name]
    assert rc == 0 and text.startswith(f"usage: python -m diloco_jax {name} [flags]") and "--" in text, name
    assert not jax_loaded, f"{name} --help imported jax"  # a light module, or light help (`Command.flags`)
    assert ("--config:" in text) == entry.config or not entry.flags, name
  assert "--workdir" in out["train"][1] and "--model" in out["eval"][1] and "--learner-id" in out["learner"][1]
  assert "--num-processes" in out["learner"][1]  # the flags of a multi-host learner, from the environment
  # The light help is the module's: its docstring, word for word.
  assert commands.resolve(commands.COMMANDS["syncer"].target).__module__ == "diloco_jax.syncer.app"
  syncer_doc = ast.get_docstring(ast.parse((PACKAGE / "syncer" / "app.py").read_text()))
  assert syncer_doc.strip() in out["syncer"][1]


def _parse_calls(module: str) -> list[ast.Call]:
  path = helpers.REPO.joinpath(*module.split(".")).with_suffix(".py")
  return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
          and isinstance(n.func, ast.Attribute) and n.func.attr in ("parse", "parse_with_args")
          and isinstance(n.func.value, ast.Name) and n.func.value.id == "cli"]


def test_a_command_with_light_help_parses_with_the_flags_the_table_names():
  """The help built from `Command.flags` ("module:function") is what the command parses: its module calls
  `cli.parse(argv, <module>.<function>, ...)` with `config` as the table says."""
  light = [(path, entry) for path, entry in _leaves(commands.COMMANDS) if entry.flags]
  assert len(light) >= 21
  for path, entry in light:
    calls = _parse_calls(entry.target.split(":")[0])
    assert len(calls) == 1, (path, len(calls))
    define = calls[0].args[1]
    module, function = entry.flags.split(":")
    assert isinstance(define, ast.Attribute) and define.value.id == module.rsplit(".", 1)[1], path
    assert define.attr == function and function in _functions(module), (path, define.attr, entry.flags)
    config = {k.arg: k.value for k in calls[0].keywords}.get("config")
    # config=False literally, or a run-time choice (chaos: not when it only summarizes): help shows --config
    assert (isinstance(config, ast.Constant) and config.value is False) == (not entry.config), path
