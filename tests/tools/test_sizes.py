"""`python -m diloco_jax sizes`: modules, classes and functions measured, the ones over the targets listed,
generated protobuf left out."""

import subprocess
import sys

import helpers
from diloco_jax.tools import sizes


def test_measure_lists_what_is_over_the_targets(tmp_path):
  pkg = tmp_path / "pkg"
  (pkg / "proto").mkdir(parents=True)
  body = "\n".join(f"  x{i} = {i}" for i in range(60))
  (pkg / "small.py").write_text(f"def long():\n{body}\n\n\ndef short():\n  return 1\n")
  (pkg / "big.py").write_text("\n".join(f"y{i} = {i}" for i in range(401)) + "\n")
  (pkg / "proto" / "x_pb2.py").write_text("\n".join(f"z{i} = {i}" for i in range(1000)) + "\n")
  measured = sizes.measure(pkg)
  assert "pkg/proto/x_pb2.py" not in {s.where for s in measured}
  over = sizes.over_targets(measured)
  assert [(s.lines, s.where, s.kind) for s in over] == [(401, "pkg/big.py", "module"),
                                                        (61, "pkg/small.py:long", "function")]
  text = sizes.format_sizes(measured)
  assert "largest module: 401 lines  pkg/big.py" in text and "over the targets: 2" in text
  assert "largest class" not in text  # none to show


def test_the_command_prints_the_package_and_exits_0():
  proc = subprocess.run([sys.executable, "-m", "diloco_jax", "sizes"], cwd=helpers.REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("largest module: ") and lines[1].startswith("largest class: ")
  assert lines[2].startswith("largest function: ") and any(x.startswith("over the targets") for x in lines)
  assert "_pb2" not in proc.stdout


def test_the_package_meets_the_size_targets():
  # Modules <= 400 lines, classes <= 300, functions <= 60 (docs/architecture.md, "Sizes": no exceptions).
  over = sizes.over_targets(sizes.measure())
  assert not over, f"over the size targets: {[(s.where, s.kind, s.lines) for s in over]}"
