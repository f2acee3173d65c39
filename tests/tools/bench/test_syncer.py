"""`bench syncer`: the fused and unfused paths agree, and the command prints its table."""

import json

from diloco_jax.tools.bench import syncer as bench_syncer


def test_fused_and_unfused_paths_agree():
  for down in ("fp32", "int4"):
    assert bench_syncer.agreement(size=20_000, pushes=3, up="int4", down=down, rounds=3) < 1e-6


def test_command_prints_rows_and_the_bound(capsys):
  assert bench_syncer.bench_syncer(["bench syncer", "--params=50000", "--rounds=1", "--threads=1,2", "--json"]) == 0
  result = json.loads(capsys.readouterr().out)
  paths = [(r["path"], r["threads"]) for r in result["rows"]]
  assert paths == [("unfused", 1), ("fused", 1), ("fused", 2)]
  for r in result["rows"]:
    assert r["params_per_cpu_s"] > 0 and r["wall_s"] > 0
  assert result["bound_params_per_s"] > 0 and result["bytes_touched"] > 4 * 4 * 50_000
  assert result["fused_vs_unfused_max_rel_diff"] < 1e-6
