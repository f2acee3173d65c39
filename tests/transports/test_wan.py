"""WAN emulation in the gRPC client: latency once per stream, and the bandwidth cap over a real service."""

import threading
import time

import numpy as np
import pytest

import helpers
from diloco_jax.syncer.server import grpc_service as service
from diloco_jax.transports import wan as wan_lib
from diloco_jax.transports.errors import SyncerUnreachable
from diloco_jax.transports.grpc_client import GrpcTransport

TOKEN = "wan-test-token"


def client(port, **kw):
  return GrpcTransport(f"127.0.0.1:{port}", TOKEN, 0, unreachable_deadline_s=2.0, **kw)


def test_wan_link_latency_once_per_stream():
  sleeps = []
  link = wan_lib.WanLink(wan_lib.WanSpec(latency_s=0.05), sleep=sleeps.append)
  link.send(10, first=True)
  link.send(10)
  link.receive(10, first=True)
  assert sleeps == [0.05, 0.05] and abs(link.delay_s - 0.1) < 1e-12


def test_wan_cap_limits_push_throughput():
  n = 256 * 1024  # floats: 1 MiB of fp32
  big = helpers.make_core((n,))
  handle2 = service.serve(big, "127.0.0.1:0", token=TOKEN)
  cap = 4e6  # bytes/s
  link = wan_lib.WanLink(wan_lib.WanSpec(up_bytes_per_s=cap, down_bytes_per_s=cap, burst_s=16 * 1024 / cap))
  try:
    with client(handle2.port) as warm:  # the first outer step compiles: keep that out of the timing
      warm.join(0, helpers.FP)
      warm.push(helpers.make_push(0, np.full(n, 1e-3, np.float32), core=big))
    with client(handle2.port, wan=link, chunk_bytes=64 * 1024) as t:
      t.join(0, helpers.FP)
      push = helpers.make_push(0, np.full(n, 1e-3, np.float32), core=big, base_version=1)
      sent = t.bytes_sent
      start = time.monotonic()
      t.push(push)
      elapsed = time.monotonic() - start
      moved = t.bytes_sent - sent
      # The cap holds: beyond the burst, the bytes took at least bytes / cap seconds. (A lower bound on
      # the rate would test this machine's load, not the code; the token bucket's exact waits are
      # checked on a fake clock above.)
      assert elapsed >= 0.95 * (moved - 16 * 1024) / cap, (moved, elapsed)
      assert link.delay_s > 0
  finally:
    handle2.stop(grace=0)


def test_cut_off_link_drops_calls_until_the_file_goes(tmp_path):
  """While the cut-off file exists every call is lost and retried (as if the syncer were unreachable);
  once it is removed the pending call goes through; a call still cut off at the deadline fails."""
  core = helpers.make_core((8,))
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN)
  cut = tmp_path / "cut_0"
  try:
    link = wan_lib.WanLink(wan_lib.WanSpec(cutoff_file=str(cut)))
    with GrpcTransport(f"127.0.0.1:{handle.port}", TOKEN, 0, wan=link, unreachable_deadline_s=30.0,
                       max_backoff_s=0.1) as t:
      t.join(0, helpers.FP)
      cut.touch()
      threading.Timer(1.0, cut.unlink).start()
      start = time.monotonic()
      assert t.heartbeat(0, 0.1, step=3) == core.epoch  # went through once the link came back
      assert time.monotonic() - start >= 0.9 and t.retries >= 3
      assert core.status()["members"]["0"]["step"] == 3
    cut.touch()
    with GrpcTransport(f"127.0.0.1:{handle.port}", TOKEN, 0, wan=link, unreachable_deadline_s=0.5,
                       max_backoff_s=0.1) as t:
      with pytest.raises(SyncerUnreachable):
        t.join(0, helpers.FP)
  finally:
    handle.stop(grace=0)
