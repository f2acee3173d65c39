"""The import rules of docs/architecture.md, checked on the package's source (every import statement,
at module level or inside a function) and, for the in-process run, on a fresh interpreter's sys.modules."""

import ast
import pathlib
import subprocess
import sys

import pytest

import helpers

PACKAGE = helpers.REPO / "diloco_jax"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(helpers.REPO).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
  """Every module `path` imports (absolute names; `from a import b` counts as a and a.b)."""
  out = set()
  package = _module_name(path).rsplit(".", 1)[0]
  for node in ast.walk(ast.parse(path.read_text())):
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
    ("diloco_jax.protocol.messages", "diloco_jax.syncer", "the protocol sits between both sides"),
    ("diloco_jax.protocol.messages", "diloco_jax.learner", "the protocol sits between both sides"),
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
              or _under(m, "diloco_jax.transports.grpc_client") or _under(m, "diloco_jax.protocol.proto.diloco_pb2")}, sorted(reached)
  # And on a real interpreter (nothing third-party pulls grpc in either).
  code = ("import sys, diloco_jax.runs.inprocess; "
          "bad = [m for m in sys.modules if m.split('.')[0] == 'grpc' or m.startswith('diloco_jax.protocol.proto.')]; "
          "assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], cwd=helpers.REPO, check=True, timeout=120)


def test_the_syncer_core_reaches_no_transport_and_no_model():
  reached = _closure("diloco_jax.syncer.core")
  assert not {m for m in reached if _under(m, "grpc") or _under(m, "diloco_jax.compute.model")
              or _under(m, "diloco_jax.transports") or _under(m, "diloco_jax.learner")}, sorted(reached)


def test_the_graph_is_read_from_the_real_package():
  # The rules above would pass vacuously on an empty or misparsed graph.
  assert "diloco_jax.syncer.core" in GRAPH and "diloco_jax.protocol.messages" in GRAPH["diloco_jax.syncer.core"]
  assert "diloco_jax.transports.grpc_client" in GRAPH["diloco_jax.learner.process"]
