"""WAN emulation in the gRPC client: latency once per stream, and the bandwidth cap over a real service."""

import time

import numpy as np

import helpers
from diloco_jax.syncer import service
from diloco_jax.transports import wan as wan_lib
from diloco_jax.transports.grpc import GrpcTransport

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
  link = wan_lib.WanLink(wan_lib.WanSpec(up_bytes_per_s=cap, down_bytes_per_s=cap, burst_bytes=16 * 1024))
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
