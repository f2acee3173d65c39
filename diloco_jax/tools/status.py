"""`python -m diloco_jax status --syncer HOST:PORT [--watch]`: what a running syncer is doing, as tables.

  DILOCO_TOKEN=... python -m diloco_jax status --syncer 127.0.0.1:50051 --watch
  python -m diloco_jax status --syncer 127.0.0.1:50051 --token-file runs/default/token

The run token comes from `--token-file` or $DILOCO_TOKEN (`python -m diloco_jax local` writes it to
`WORKDIR/token` and prints the syncer's port). Shown: the syncer (uptime, live learners, goodput so far),
one row per learner, one row per fragment, and the counters; what each column means: docs/observability.md,
"Status of a live syncer". `--watch` redraws every `--interval` seconds until Ctrl-C; `--json` prints the
raw status instead. The command is an observer: it never joins, so it changes nothing.

A sharded syncer: `--syncer HOST:PORT,HOST:PORT` (every shard, in shard order) shows each shard's tables
in turn (its learners as that shard sees them, its fragments, its counters); `--json` prints the combined
status with every shard's under `shards` (`transports/sharded.py`).
"""

from __future__ import annotations

import json
import sys
import time

from absl import flags

from diloco_jax import cli
from diloco_jax.protocol import messages as protocol
from diloco_jax.transports import client_flags, sharded
from diloco_jax.transports.errors import AuthError, SyncerError, SyncerUnreachable
from diloco_jax.transports.grpc_client import GrpcTransport

_CLEAR = "\x1b[H\x1b[2J"


def _flags(fv: flags.FlagValues) -> None:
  client_flags.define(fv)
  flags.DEFINE_bool("watch", False, "redraw every --interval seconds until Ctrl-C", flag_values=fv)
  flags.DEFINE_float("interval", 2.0, "seconds between two redraws with --watch", flag_values=fv,
                     lower_bound=0.1)
  flags.DEFINE_bool("json", False, "print the syncer's raw status (JSON) instead of tables", flag_values=fv)
  flags.DEFINE_float("timeout-s", 10.0, "give up on an unreachable syncer after this long", flag_values=fv)


def _seconds(s: float | None) -> str:
  if s is None:
    return "-"
  if s < 1:
    return f"{1e3 * s:.0f}ms"
  if s < 60:
    return f"{s:.1f}s"
  if s < 3600:
    return f"{int(s // 60)}m{int(s % 60):02d}s"
  return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return f"{n:.2f} TiB"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
  line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
  return [line(header)] + [line(r) for r in rows]


def format_status(status: dict, target: str = "") -> str:
  """The tables of a syncer `status()` (as the Status RPC returns it)."""
  c = status["counters"]
  members = status.get("members", {})
  num = status.get("num_learners") or len(members)
  out = [f"syncer {target}  fingerprint {status['fingerprint']}  up {_seconds(status.get('uptime_s'))}  "
         f"live {len(status['live'])}/{num}  goodput so far {status.get('goodput_estimate', 0.0):.1%} "
         f"(syncer's estimate)", ""]
  rows = [[i, "yes" if m["live"] else ("left" if m["left"] else "no"),
           "-" if m.get("step") is None else f"{m['step']} ({_seconds(m.get('step_ago_s'))} ago)",
           _seconds(m["step_time_s"]) if m["step_time_s"] else "-",
           "-" if m.get("last_push_ago_s") is None else f"{_seconds(m['last_push_ago_s'])} ago",
           f"{m.get('steps_merged', 0):.0f}", _seconds(m["lease_left_s"])]
          for i, m in sorted(members.items(), key=lambda kv: int(kv[0]))]
  out += _table(["learner", "alive", "step", "step time", "last push", "steps merged", "lease left"],
                rows or [["(none joined)", "", "", "", "", "", ""]])
  out.append("")
  open_rounds = status.get("open_rounds", {})
  rows = []
  owned = set(status.get("owned", range(len(status["versions"]))))
  for p, version in enumerate(status["versions"]):
    if p not in owned:
      continue  # another shard's
    rnd = open_rounds.get(str(p))
    rows.append([p, version, ",".join(str(i) for i in rnd["contributors"]) if rnd else "-",
                 "-" if not rnd or rnd["deadline_in_s"] is None else _seconds(max(rnd["deadline_in_s"], 0.0))])
  out += _table(["fragment", "version", "open round: contributors", "closes in"], rows)
  out.append("")
  rejected = {r: n for r, n in c["rejected"].items() if n}
  since = status.get("since_start", {})
  n = since.get("rounds", 0)
  out.append(f"rounds {c['rounds']}  contributions merged {c['contributions_merged']} (late {c['contributions_late']})"
             + (f"  since start: contributors/round {since['contributors'] / n:.2f}, grace wait/round "
                f"{_seconds(since['grace_wait_s'] / n)}" if n else ""))
  out.append(f"contributions rejected {c['contributions_rejected']}, requests refused by reason "
             + ("(" + ", ".join(f"{r} {n}" for r, n in sorted(rejected.items())) + ")" if rejected else "(none)")
             + f"  tokens merged {c['tokens_merged'] / max(len(owned), 1):,.0f}"
             + f"  bytes in {_bytes(c['bytes_in'])}, out {_bytes(c['bytes_out'])}"
             + f"  joins {c['joins']}, leaves {c['leaves']}, leases expired {c['leases_expired']}")
  return "\n".join(out)


def show_status(argv) -> int:
  """`python -m diloco_jax status --syncer HOST:PORT [--watch]`; see the module docstring."""
  fv = cli.parse(argv, _flags, doc=__doc__, config=False)
  targets, token = client_flags.targets(fv), client_flags.token(fv)
  redraw = fv.watch and sys.stdout.isatty()
  try:
    with sharded.connect(targets, lambda target: GrpcTransport(
        target, token, protocol.OBSERVER_ID, unreachable_deadline_s=fv["timeout-s"].value,
        **client_flags.tls(fv))) as transport:
      while True:
        if fv.json:
          text = json.dumps(transport.status(), indent=1, sort_keys=True)
        elif len(targets) == 1:
          text = format_status(transport.status(), targets[0])
        else:
          text = "\n\n".join(format_status(s, f"shard {i}/{len(targets)} {target}")
                              for i, (s, target) in enumerate(zip(transport.shard_statuses(), targets)))
        print((_CLEAR if redraw else "") + text + ("\n" if fv.watch and not redraw else ""), flush=True)
        if not fv.watch:
          return 0
        time.sleep(fv.interval)
  except KeyboardInterrupt:
    return 0
  except (SyncerUnreachable, AuthError, SyncerError) as e:
    print(cli.prefixed("status", e), file=sys.stderr)
    return 1
