"""Every module of the package says what it holds in a docstring of at most 15 lines: the detail lives in the
docstring of the function or class that implements it, or in docs/*.md. Generated protobuf is left out; an
empty `__init__.py` is a package marker with nothing to say."""

import ast

import helpers

PACKAGE = helpers.REPO / "diloco_jax"
MAX_LINES = 15



def _docstrings() -> dict[str, str | None]:
  """{module path relative to the repository: its docstring as written (None: none)}."""
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
      continue
    source = path.read_text()
    if path.name == "__init__.py" and not source.strip():
      continue
    out[str(path.relative_to(helpers.REPO))] = ast.get_docstring(ast.parse(source), clean=False)
  return out


def _lines(doc: str) -> int:
  return len(doc.splitlines())


def test_every_module_has_a_docstring():
  missing = [module for module, doc in _docstrings().items() if not (doc and doc.strip())]
  assert not missing, f"modules without a docstring: {missing}"


def test_module_docstrings_are_at_most_15_lines():
  long = {module: _lines(doc) for module, doc in _docstrings().items()
          if doc and _lines(doc) > MAX_LINES}
  assert not long, f"module docstrings over {MAX_LINES} lines (move the detail to the code it describes or " \
                   f"to docs/*.md, with a pointer): {long}"

