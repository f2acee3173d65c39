"""Regenerate `diloco_pb2.py` and `diloco_pb2_grpc.py` from `diloco.proto`.

Run after editing the proto: `python -m diloco_jax.protocol.proto.regen`. The generated code is committed so that
installing the package needs no protoc; grpc_tools (a pinned dependency) provides the compiler. protoc
writes `import diloco_pb2` in the service module; that is rewritten to a package-relative import so the
code works as part of `diloco_jax.protocol.proto`.
"""

from __future__ import annotations

import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent


def regenerate(argv=None) -> int:
  """Runs protoc on diloco.proto and makes the service module import its messages package-relative."""
  del argv
  import grpc_tools  # noqa: PLC0415 - a developer tool's dependency, not the package's
  from grpc_tools import protoc  # noqa: PLC0415 - a developer tool's dependency, not the package's

  include = pathlib.Path(grpc_tools.__file__).parent / "_proto"  # well-known types
  rc = protoc.main([
      "grpc_tools.protoc",
      f"-I{HERE}",
      f"-I{include}",
      f"--python_out={HERE}",
      f"--pyi_out={HERE}",
      f"--grpc_python_out={HERE}",
      str(HERE / "diloco.proto"),
  ])
  if rc != 0:
    print(f"protoc failed with exit code {rc}", file=sys.stderr)
    return rc
  grpc_module = HERE / "diloco_pb2_grpc.py"
  text = grpc_module.read_text()
  text = re.sub(r"^import diloco_pb2 as", "from . import diloco_pb2 as", text, flags=re.M)
  grpc_module.write_text(text)
  print(f"regenerated {HERE / 'diloco_pb2.py'} and {grpc_module}")
  return 0


if __name__ == "__main__":
  sys.exit(regenerate())
