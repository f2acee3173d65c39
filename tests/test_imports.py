"""The import rules of docs/architecture.md, checked on the package's source (every import statement,
at module level or inside a function) and, for the in-process run and the jax-free layers, on a fresh
interpreter's sys.modules.

The layers, bottom to top (a module imports its own layer and those below, never one above):

  0  config/, outer/                       settings and the numpy outer step: no jax
  1  protocol/, compute/, data/            messages and wire; the JAX core; the data pipeline
  2  cli.py, metrics.py                    shells shared by every process and tool (flags, metrics files)
  3  syncer/, transports/, learner/, evaluator/   the runtime's parts (their own rules below);
     command_flags.py                      the flags of the commands that load jax (their light --help)
  4  runs/                                 in-process run, local launcher, baseline, end-of-run outputs
  5  tools/                                what a user runs to measure, plot, inspect or prepare
  6  commands.py, __main__.py             the one commands table (names tools by string, imports none)

Also: tools/ is never imported from outside tools/; no import cycle among the package's modules; the
syncer's rules import only numpy, the standard library, protocol/ and outer/; config/ and outer/ reach no
jax, flax, optax or orbax."""

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

import helpers

PACKAGE = helpers.REPO / "diloco_jax"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(helpers.REPO).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
  """Every node of `tree` except those under `if TYPE_CHECKING:` (imports a type checker sees, never run)."""
  todo = [tree]
  while todo:
    node = todo.pop()
    if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
      todo.extend(node.orelse)
      continue
    todo.extend(ast.iter_child_nodes(node))
    yield node


def _imports(path: pathlib.Path) -> set[str]:
  """Every module `path` imports when it runs (absolute names; `from a import b` counts as a and a.b)."""
  out = set()
  package = _module_name(path).rsplit(".", 1)[0]
  for node in _runtime_nodes(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
      out.add(base)
      out.update(f"{base}.{alias.name}" for alias in node.names)
  return out


GRAPH = {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _under(name: str, prefix: str) -> bool:
  return name == prefix or name.startswith(prefix + ".")


def _closure(module: str) -> set[str]:
  """The package modules `module` imports, transitively (third-party modules as their first import)."""
  seen, todo = set(), [module]
  while todo:
    m = todo.pop()
    if m in seen:
      continue
    seen.add(m)
    todo.extend(i for i in GRAPH.get(m, ()) if i in GRAPH or not _under(i, "diloco_jax"))
  return seen


# (importer prefix, forbidden prefix, why)
RULES = [
    ("diloco_jax.learner", "diloco_jax.syncer", "a learner knows the syncer only through protocol + transports"),
    ("diloco_jax.transports", "diloco_jax.syncer", "transports carry protocol messages, not syncer internals"),
    ("diloco_jax.protocol", "diloco_jax.syncer", "the protocol sits between both sides"),
    ("diloco_jax.protocol", "diloco_jax.learner", "the protocol sits between both sides"),
    ("diloco_jax.protocol", "diloco_jax.transports", "the protocol sits between both sides"),
    ("diloco_jax.syncer.core", "grpc", "the core knows no transport"),
    ("diloco_jax.syncer.core", "diloco_jax.protocol.proto", "the core knows no transport"),
    ("diloco_jax.syncer.core", "diloco_jax.transports", "the core knows no transport"),
    ("diloco_jax.syncer.core", "diloco_jax.compute.model", "the core knows no model"),
    ("diloco_jax.syncer.downlink", "diloco_jax.compute.model", "the core knows no model"),
    ("diloco_jax.syncer.rules.quorum", "diloco_jax", "the policy is pure arithmetic, shared with the simulator"),
    ("diloco_jax.evaluator", "diloco_jax.syncer", "the evaluator is an observer: it knows the syncer only "
     "through protocol + transports"),
    ("diloco_jax.evaluator.loop", "grpc", "the evaluator's loop runs in process too (train), without grpc"),
    ("diloco_jax.evaluator.loop", "diloco_jax.transports", "the evaluator's loop takes any Transport"),
    ("diloco_jax.config", "jax", "the config is pure: schema, checks and resolution import no jax"),
    ("diloco_jax.config", "flax", "the config is pure: schema, checks and resolution import no flax"),
    ("diloco_jax.config", "optax", "the config is pure: schema, checks and resolution import no optax"),
    ("diloco_jax.config", "diloco_jax.compute", "the config knows no model or mesh (compute imports config)"),
]


@pytest.mark.parametrize("importer,forbidden,why", RULES)
def test_direct_imports_follow_the_rules(importer, forbidden, why):
  bad = sorted((m, i) for m, imports in GRAPH.items() if _under(m, importer)
               for i in imports if _under(i, forbidden) and not (m == i))
  assert not bad, f"{why}: {bad}"


def test_the_in_process_run_never_reaches_the_grpc_service():
  reached = _closure("diloco_jax.runs.inprocess")
  assert not {m for m in reached if _under(m, "grpc") or _under(m, "diloco_jax.syncer.server.grpc_service")
              or _under(m, "diloco_jax.transports.grpc_client")
              or _under(m, "diloco_jax.protocol.proto.diloco_pb2")}, sorted(reached)
  # And on a real interpreter. The grpc package itself may be loaded there: with the gcs extra installed,
  # tensorboardX imports google.cloud.storage, whose google.auth imports grpc; what must stay out is our
  # gRPC service, client and generated messages.
  code = ("import sys, diloco_jax.runs.inprocess; "
          "bad = [m for m in sys.modules if m.startswith('diloco_jax.protocol.proto.') "
          "or m in ('diloco_jax.transports.grpc_client', 'diloco_jax.syncer.server.grpc_service', "
          "'diloco_jax.syncer.server.grpc_frontend')]; "
          "assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], cwd=helpers.REPO, check=True, timeout=120)


PROTO_MESSAGES = "diloco_jax.protocol.proto.diloco_pb2"
PROTO_STUBS = "diloco_jax.protocol.proto.diloco_pb2_grpc"


def test_protobuf_is_converted_in_one_module_and_its_stubs_are_used_by_the_grpc_ends_only():
  # The generated messages are built and read only by protocol/convert.py; the generated service (stub and
  # servicer base) only by the gRPC front-end and the gRPC client. (The generated package itself aside.)
  def importers(module):
    return {m for m, imports in GRAPH.items() if module in imports and not _under(m, "diloco_jax.protocol.proto")}

  assert importers(PROTO_MESSAGES) == {"diloco_jax.protocol.convert"}
  assert importers(PROTO_STUBS) == {"diloco_jax.syncer.server.grpc_frontend", "diloco_jax.transports.grpc_client"}


def test_the_protocol_imports_no_grpc():
  # The in-process run uses the protocol: only the generated service module may import grpc.
  bad = sorted((m, i) for m, imports in GRAPH.items() if _under(m, "diloco_jax.protocol") and m != PROTO_STUBS
               for i in imports if _under(i, "grpc"))
  assert not bad, bad


def test_the_syncer_core_reaches_no_transport_and_no_model():
  reached = _closure("diloco_jax.syncer.core")
  assert not {m for m in reached if _under(m, "grpc") or _under(m, "diloco_jax.compute.model")
              or _under(m, "diloco_jax.transports") or _under(m, "diloco_jax.learner")}, sorted(reached)


def test_the_outer_math_reaches_no_jax():
  outer = [m for m in GRAPH if _under(m, "diloco_jax.outer")]
  reached = set().union(*(_closure(m) for m in outer))
  assert len(outer) > 5 and not {m for m in reached if m.split(".")[0] in ("jax", "flax", "optax")}, sorted(reached)


def test_the_graph_is_read_from_the_real_package():
  # The rules above would pass vacuously on an empty or misparsed graph.
  assert "diloco_jax.syncer.core" in GRAPH and "diloco_jax.protocol.messages" in GRAPH["diloco_jax.syncer.core"]
  assert "diloco_jax.transports.grpc_client" in GRAPH["diloco_jax.learner.process"]


LAYERS = [
    ("diloco_jax.config", "diloco_jax.outer"),
    ("diloco_jax.protocol", "diloco_jax.compute", "diloco_jax.data"),
    ("diloco_jax.cli", "diloco_jax.metrics"),
    ("diloco_jax.syncer", "diloco_jax.transports", "diloco_jax.learner", "diloco_jax.evaluator",
     "diloco_jax.command_flags"),
    ("diloco_jax.runs",),
    ("diloco_jax.tools",),
    ("diloco_jax.commands", "diloco_jax.__main__"),
]
JAX_FAMILY = ("jax", "jaxlib", "flax", "optax", "orbax")


def _layer(name: str) -> int | None:
  return next((i for i, prefixes in enumerate(LAYERS) if any(_under(name, p) for p in prefixes)), None)


def _edges(module: str) -> set[str]:
  """The package modules `module` imports (`from a import b`: a.b if it is a module, else a)."""
  out = set()
  for i in GRAPH[module]:
    if i in GRAPH:
      out.add(i)
    elif _under(i, "diloco_jax") and i.rsplit(".", 1)[0] in GRAPH:
      out.add(i.rsplit(".", 1)[0])
  return out - {module}


def test_every_module_has_a_layer():
  assert not [m for m in GRAPH if m != "diloco_jax" and _layer(m) is None]


PENDING_LAYERS = {
}


@pytest.mark.parametrize("importer", [
    pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=PENDING_LAYERS[p])) if p in PENDING_LAYERS else p
    for layer in LAYERS for p in layer])
def test_no_upward_import(importer):
  bad = sorted((m, i) for m in GRAPH if _under(m, importer) for i in _edges(m)
               if _layer(i) is not None and _layer(i) > _layer(m))
  assert not bad, f"a lower layer imports a higher one (see the module docstring): {bad}"


def test_tools_are_never_imported_from_outside_tools():
  bad = sorted((m, i) for m in GRAPH if not _under(m, "diloco_jax.tools")
               for i in GRAPH[m] if _under(i, "diloco_jax.tools"))
  assert not bad, f"the runtime (and everything outside tools/) never imports a tool: {bad}"


def _cycles() -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan), each sorted."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(_edges(v)):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(GRAPH):
    if v not in index:
      visit(v)
  return out


def test_no_import_cycle():
  assert not _cycles()


def test_the_cycle_check_finds_a_cycle(monkeypatch):
  monkeypatch.setitem(GRAPH, "diloco_jax.metrics", GRAPH["diloco_jax.metrics"] | {"diloco_jax.cli"})
  monkeypatch.setitem(GRAPH, "diloco_jax.cli", GRAPH["diloco_jax.cli"] | {"diloco_jax.metrics"})
  assert ["diloco_jax.cli", "diloco_jax.metrics"] in _cycles()


def test_syncer_rules_import_only_numpy_the_standard_library_protocol_and_outer():
  # The rules decide on the typed state (syncer/state.py: dataclasses over numpy), held to the same rule.
  allowed = ("diloco_jax.protocol", "diloco_jax.outer", "diloco_jax.syncer.rules", "diloco_jax.syncer.state")
  rules = [m for m in GRAPH if _under(m, "diloco_jax.syncer.rules") or m == "diloco_jax.syncer.state"]
  assert {"diloco_jax.syncer.rules.quorum", "diloco_jax.syncer.rules.admission",
          "diloco_jax.syncer.state"} <= set(rules)
  bad = sorted((m, i) for m in rules for i in GRAPH[m]
               if not (i.split(".")[0] in sys.stdlib_module_names or i.split(".")[0] == "numpy"
                       or any(_under(i, a) for a in allowed)))
  assert not bad, f"the syncer's rules are pure (numpy, stdlib, protocol, outer): {bad}"


def _reaches_no_jax(package: str) -> None:
  modules = sorted(m for m in GRAPH if _under(m, package))
  reached = {m: sorted(i for i in _closure(m) if i.split(".")[0] in JAX_FAMILY) for m in modules}
  assert not {m: r for m, r in reached.items() if r}, reached
  # And on a real interpreter (a third-party import may pull jax in too).
  code = textwrap.dedent(f"""
      import importlib, sys
      for m in {modules!r}:
        importlib.import_module(m)
      bad = sorted(m for m in sys.modules if m.split('.')[0] in {JAX_FAMILY!r})
      assert not bad, bad
  """)
  subprocess.run([sys.executable, "-c", code], cwd=helpers.REPO, check=True, timeout=120)


def test_config_reaches_no_jax():
  _reaches_no_jax("diloco_jax.config")


def test_outer_reaches_no_jax():
  _reaches_no_jax("diloco_jax.outer")
