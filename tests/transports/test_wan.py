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


def test_a_message_pays_its_latency_and_what_exceeds_a_burst_of_a_few_ms():
  now = [0.0]
  sleeps = []
  spec = wan_lib.WanSpec(up_bytes_per_s=1e6, down_bytes_per_s=1e6, latency_s=0.02, burst_s=0.002,
                         header_overhead=0.0)
  link = wan_lib.WanLink(spec, clock=lambda: now[0], sleep=sleeps.append)
  link.send(10_000, first=True)  # 2 KB of burst, then 8 KB at 1 MB/s, behind the one-way latency
  assert sleeps == [pytest.approx(0.02 + 0.008)]
  now[0] += 1.0  # the bucket refills to its burst, not beyond
  link.receive(1_000, first=True)
  link.send(3_000)
  assert sleeps[1:] == [pytest.approx(0.02), pytest.approx(0.001)]
  link.connect(tls=False)
  link.connect(tls=True)
  assert sleeps[3:] == [pytest.approx(3 * 0.02), pytest.approx(5 * 0.02)]  # TCP's round trip (+ TLS 1.3's) + a leg
  heavy = wan_lib.WanLink(wan_lib.WanSpec(up_bytes_per_s=1e6, burst_s=0.0), clock=lambda: now[0], sleep=sleeps.append)
  heavy.send(1448)  # a segment's payload and its TCP/IP/Ethernet headers
  assert sleeps[-1] == pytest.approx((1448 + 66) / 1e6)


def test_a_data_plane_transfer_pays_its_connection_once_then_two_legs():
  # What a real link charges in one-way latencies L: a new connection 2 L (TCP) + L (the leg before the
  # server speaks) + its hello L, then each request L and each reply L; a persistent connection only the
  # last two. Sleeps recorded, not slept; no bandwidth cap, so only latency is charged.
  core = helpers.make_core((300,), codec="int4")
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN)
  latency = 0.01
  link = wan_lib.WanLink(wan_lib.WanSpec(latency_s=latency), sleep=lambda s: None)
  try:
    with client(handle.port, wan=link) as t:
      charged = []

      def call(f):
        before = link.delay_s
        f()
        charged.append(round((link.delay_s - before) / latency, 6))

      call(lambda: t.join(0, helpers.FP))  # gRPC: request and reply
      call(lambda: t.push(helpers.make_push(0, helpers.small_delta(300), core=core)))  # a new connection
      call(lambda: t.pull(0, 1))  # the connection again
      call(lambda: t.push(helpers.make_push(0, helpers.small_delta(300, seed=1), core=core, base_version=1)))
      assert charged == [2, 6, 2, 2] and t.data_connections == 1
  finally:
    handle.stop(grace=0)
