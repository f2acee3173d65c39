"""`python -m diloco_jax bench transport [--mb 64] [--json]`: fragment push/pull throughput over loopback.

For each codec (fp32/bf16/int8/int4) a fragment of `--mb` MB of float32 parameters is encoded, then pushed
to and pulled from a syncer service running in a separate process (so that each end's memory is its own),
through the real client (`GrpcTransport`: auth, byte counters) and the real service (`syncer/server/grpc_service.py`:
auth, validation, reassembly), twice: payloads in gRPC chunks (`grpc`), and over the service's raw-TCP data
plane (`data`: `syncer/server/dataplane.py`, with gRPC as the control plane). Behind the service is a stub
`SyncerAPI` that checks the
payload's CRC-32 and serves a pre-encoded fragment: the figures are the transport's, not the outer step's.
Beside it, the same bytes go through a raw TCP socket in the same run: the floor that gRPC is measured
against. Peak RSS: psutil high-water marks sampled every 2 ms in each process during each codec's transfers.

MB/s counts encoded payload bytes (1 MB = 1e6 bytes); times are the best of `--repeats`, after one
untimed transfer of each kind (a steady state reuses its payload buffers, `chunking.BufferPool`).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
from absl import flags

from diloco_jax import cli
from diloco_jax.outer import codec as codec_lib
from diloco_jax.outer.codec import CODECS
from diloco_jax.protocol.messages import Published, Push, PushReceipt, Versions
from diloco_jax.protocol.reasons import Reason, Rejected
from diloco_jax.syncer.server import grpc_service as service
from diloco_jax.syncer.server import limits as limits_lib
from diloco_jax.transports.grpc_client import GrpcTransport

TOKEN_ENV = "DILOCO_BENCH_TOKEN"


class RssSampler:
  """Peak resident memory of this process, sampled in a daemon thread."""

  def __init__(self, period_s: float = 0.002):
    self._proc = psutil.Process()
    self._peak = self._proc.memory_info().rss
    self._lock = threading.Lock()
    self._period = period_s
    threading.Thread(target=self._run, daemon=True, name="rss-sampler").start()

  def _run(self):
    while True:
      rss = self._proc.memory_info().rss
      with self._lock:
        self._peak = max(self._peak, rss)
      time.sleep(self._period)

  def reset(self) -> int:
    """The peak since the last reset (bytes); the next period starts from the current RSS."""
    rss = self._proc.memory_info().rss
    with self._lock:
      peak, self._peak = max(self._peak, rss), rss
    return peak


# --- the server process -----------------------------------------------------------------------------------


class _BenchCore:
  """A `protocol.SyncerAPI` standing in for SyncerCore: fragment i is CODECS[i]'s encoding of one random
  vector."""

  def __init__(self, size: int, block: int, sampler: RssSampler):
    self._sampler = sampler
    self._max_payload = codec_lib.encoded_size(size, "fp32", block)
    vec = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    self._published = []
    for i, name in enumerate(CODECS):
      payload = codec_lib.encode(vec, name, block)
      self._published.append(Published(fragment=i, version=1, codec=name, payload=payload,
                                                 checksum=codec_lib.checksum(payload)))
    del vec
    self.pushes = 0

  def join(self, learner_id, fingerprint):
    return Versions({i: 1 for i in range(len(CODECS))})

  def leave(self, learner_id):
    pass

  def heartbeat(self, learner_id, step_time_s, step=None, blocked=False):
    return 0

  def push(self, push):
    if codec_lib.checksum(push.payload) != push.checksum:
      raise Rejected(Reason.CHECKSUM, "bench payload corrupted")
    self.pushes += 1
    return PushReceipt(fragment=push.fragment, round=self.pushes, late=False)

  def pull(self, fragment, min_version, timeout_s=0.0, have_version=-1, have_epoch=0, learner_id=None):
    return self._published[fragment]

  def status(self):
    return {"versions": [1] * len(CODECS), "peak_rss": self._sampler.reset()}

  def max_payload_bytes(self) -> int:
    return self._max_payload

  def check_learner_id(self, learner_id) -> None:
    pass


def _raw_server(sock: socket.socket, size: int):
  """Raw TCP: b'P'+u64 n: read n bytes, answer one byte. b'G'+u64 n: send n bytes."""
  out = bytes(np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8))
  buf = bytearray(size)
  while True:
    conn, _ = sock.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
      while True:
        head = _recv_exact(conn, 9)
        if head is None:
          break
        op, n = head[:1], struct.unpack("<Q", head[1:])[0]
        if op == b"P":
          view = memoryview(buf)[:n]
          got = 0
          while got < n:
            k = conn.recv_into(view[got:], n - got)
            if not k:
              break
            got += k
          conn.sendall(b"k")
        else:
          conn.sendall(memoryview(out)[:n])


def _recv_exact(conn, n):
  data = bytearray()
  while len(data) < n:
    chunk = conn.recv(n - len(data))
    if not chunk:
      return None
    data += chunk
  return bytes(data)


def _serve(size: int, block: int, chunk_kb: int) -> int:
  sampler = RssSampler()
  core = _BenchCore(size, block, sampler)
  limits = limits_lib.Limits.defaults(chunk_bytes=chunk_kb * 1024, max_push_bytes=8 * size + (1 << 20), rate_per_s=0)
  handle = service.serve(core, "127.0.0.1:0", token=os.environ[TOKEN_ENV], limits=limits)
  raw = socket.socket()
  raw.bind(("127.0.0.1", 0))
  raw.listen(1)
  threading.Thread(target=_raw_server, args=(raw, 4 * size + 1024), daemon=True).start()
  print(f"{handle.port} {raw.getsockname()[1]}", flush=True)
  sys.stdin.read()  # until the client closes our stdin
  handle.stop(grace=0)
  return 0


# --- the client -------------------------------------------------------------------------------------------


def _best(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def _raw_push(sock, payload):
  sock.sendall(b"P" + struct.pack("<Q", len(payload)))
  sock.sendall(payload)
  assert _recv_exact(sock, 1) == b"k"


def _raw_pull(sock, n, buf):
  sock.sendall(b"G" + struct.pack("<Q", n))
  view = memoryview(buf)[:n]
  got = 0
  while got < n:
    k = sock.recv_into(view[got:], n - got)
    if not k:
      raise ConnectionError("raw server closed")
    got += k


def run(mb: float, codecs=CODECS, repeats: int = 3, chunk_kb: int = 1024, block: int = 64) -> list[dict]:
  """The benchmark; returns one row per codec."""
  size = int(mb * 1e6 / 4)
  token = os.urandom(16).hex()
  env = {**os.environ, TOKEN_ENV: token, "JAX_PLATFORMS": "cpu"}
  server = subprocess.Popen([sys.executable, "-m", "diloco_jax", "bench", "transport", "--serve",
                             f"--size={size}", f"--block={block}", f"--chunk-kb={chunk_kb}"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
  try:
    grpc_port, raw_port = (int(x) for x in server.stdout.readline().split())
    sampler = RssSampler()
    vec = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    rows = []
    raw = socket.create_connection(("127.0.0.1", raw_port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw_buf = bytearray(4 * size + 1024)
    for path in ("grpc", "data"):
      with GrpcTransport(f"127.0.0.1:{grpc_port}", token, 0, chunk_bytes=chunk_kb * 1024,
                         data_plane=path == "data") as t:
        rows += _measure(t, path, codecs, vec, block, repeats, sampler, raw, raw_buf, size)
    raw.close()
    return rows
  finally:
    server.stdin.close()
    try:
      server.wait(timeout=10)
    except subprocess.TimeoutExpired:
      server.kill()


def _measure(t, path, codecs, vec, block, repeats, sampler, raw, raw_buf, size) -> list[dict]:
  rows = []
  t.join(0, "bench")
  assert (t.data_port != 0) == (path == "data"), "the data plane was not offered"
  t.status()  # resets the server's RSS peak
  for name in codecs:
    i = CODECS.index(name)
    payload = codec_lib.encode(vec, name, block)
    push = Push(learner_id=0, fingerprint="bench", fragment=i, base_version=1, steps=1, tokens=1,
                         codec=name, payload=payload, checksum=codec_lib.checksum(payload))
    t.push(push)  # warm-up, untimed: steady state reuses payload buffers (`chunking.BufferPool`)
    t.pull(i, 0)
    t.status()
    sampler.reset()
    sent0, recv0 = t.bytes_sent, t.bytes_received
    push_s = _best(lambda push=push: t.push(push), repeats)
    pull_s = _best(lambda i=i: t.pull(i, 0), repeats)
    wire_sent, wire_received = t.bytes_sent - sent0, t.bytes_received - recv0
    client_rss = sampler.reset()
    server_rss = t.status()["peak_rss"]
    n = len(payload)
    raw_push_s = _best(lambda payload=payload: _raw_push(raw, payload), repeats)
    raw_pull_s = _best(lambda n=n: _raw_pull(raw, n, raw_buf), repeats)
    rows.append({
        "codec": name, "path": path, "params": size, "payload_mb": n / 1e6,
        "push_mb_s": n / 1e6 / push_s, "pull_mb_s": n / 1e6 / pull_s,
        "raw_send_mb_s": n / 1e6 / raw_push_s, "raw_recv_mb_s": n / 1e6 / raw_pull_s,
        "push_vs_raw": raw_push_s / push_s, "pull_vs_raw": raw_pull_s / pull_s,
        "framing_overhead": (wire_sent + wire_received) / (2 * repeats * n) - 1.0,
        "client_peak_rss_mb": client_rss / 1e6, "server_peak_rss_mb": server_rss / 1e6,
    })
  return rows


def format_table(rows) -> str:
  head = (f"{'codec':<6}{'path':>5}{'payload MB':>11}{'push MB/s':>11}{'pull MB/s':>11}{'raw send':>10}"
          f"{'raw recv':>10}{'push/raw':>9}{'pull/raw':>9}{'framing':>9}{'client RSS':>12}{'server RSS':>12}")
  lines = [head, "-" * len(head)]
  for r in rows:
    lines.append(f"{r['codec']:<6}{r['path']:>5}{r['payload_mb']:>11.1f}{r['push_mb_s']:>11.0f}{r['pull_mb_s']:>11.0f}"
                 f"{r['raw_send_mb_s']:>10.0f}{r['raw_recv_mb_s']:>10.0f}{r['push_vs_raw']:>9.2f}{r['pull_vs_raw']:>9.2f}"
                 f"{100 * r['framing_overhead']:>8.3f}%{r['client_peak_rss_mb']:>10.0f}MB"
                 f"{r['server_peak_rss_mb']:>10.0f}MB")
  return "\n".join(lines)


def _flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_float("mb", 64.0, "fragment size in MB of float32 (64 = 16M params)", flag_values=fv)
  flags.DEFINE_list("codecs", list(CODECS), "codecs to measure", flag_values=fv)
  flags.DEFINE_integer("repeats", 5, "repeats per transfer after one untimed (the best counts)", flag_values=fv)
  flags.DEFINE_integer("chunk-kb", 1024, "gRPC chunk size", flag_values=fv)
  flags.DEFINE_integer("block", 64, "quantization block", flag_values=fv)
  flags.DEFINE_bool("json", False, "print the rows as JSON", flag_values=fv)
  # The server half of the benchmark runs as a child process with these (not for people).
  flags.DEFINE_bool("serve", False, "internal: run the server half", flag_values=fv)
  flags.DEFINE_integer("size", 0, "internal: the server's fragment size in parameters", flag_values=fv)


def bench_transport(argv) -> int:
  """`python -m diloco_jax bench transport [--mb 64] [--codecs fp32,int4] [--json]`."""
  fv = cli.parse(argv, _flags, doc=__doc__, config=False)
  if fv.serve:
    return _serve(fv.size, fv.block, fv["chunk-kb"].value)
  bad = [c for c in fv.codecs if c not in CODECS]
  if bad:
    raise cli.UsageError(f"--codecs: unknown codecs {bad}; expected some of {CODECS}")
  rows = run(fv.mb, fv.codecs, fv.repeats, fv["chunk-kb"].value, fv.block)
  if fv.json:
    print(json.dumps(rows, indent=2))
  else:
    print(f"loopback gRPC vs raw TCP, fragment of {fv.mb:g} MB float32, best of {fv.repeats}")
    print(format_table(rows))
  return 0
