"""The syncer service: `serve` starts the gate (`gate.py`) behind its two front-ends, gRPC
(`grpc_frontend.py`, the control plane: join, leave, heartbeat, status; and the fallback for payloads) and
the raw-TCP data plane (`dataplane.py`, push and pull payloads at socket speed).

The service only moves bytes and checks the protocol; every decision about the global model is the core's
(`syncer/core.py`), shared with the in-process transport. Authentication and TLS come from `auth.py`; the
process around it is `syncer/app.py`. Threads: the sync gRPC server serves calls on one pool of
`max_workers` threads (`limits.workers_for(config)` sizes it for a run's learners), of which the gate's
slots let a quarter serve Pushes and a half Pulls.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging

import grpc

from diloco_jax.protocol.interfaces import SyncerAPI
from diloco_jax.syncer.server.auth import AuthInterceptor, TlsConfig, check_bind
from diloco_jax.syncer.server.dataplane import DataPlaneLimits, DataPlaneServer
from diloco_jax.syncer.server.gate import SyncerGate
from diloco_jax.syncer.server.grpc_frontend import SyncerServicer
from diloco_jax.syncer.server.limits import Limits

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ServerHandle:
  """A running syncer service. `port` is the bound port (useful with port 0); `gate` the service's gate
  (its counters, slots and limits)."""

  server: grpc.Server
  port: int
  gate: SyncerGate
  servicer: SyncerServicer
  data_plane: DataPlaneServer | None = None

  def stop(self, grace: float | None = 1.0) -> None:
    """Stop accepting calls; let calls in flight finish for up to `grace` seconds."""
    if self.data_plane is not None:
      self.data_plane.stop()
    self.server.stop(grace).wait()
    self.servicer.close()

  def wait(self, timeout: float | None = None) -> bool:
    return self.server.wait_for_termination(timeout)


def serve(core: SyncerAPI, bind: str = "127.0.0.1:0", *, token: str, tls: TlsConfig | None = None,
          limits: Limits | None = None, fingerprint: str | None = None, max_workers: int = 32,
          allow_remote: bool = False, data_plane: bool = True) -> ServerHandle:
  """Start the syncer service for `core` on `bind` in a thread pool; return at once.

  Args:
    core: the `SyncerAPI` to serve (a `SyncerCore`).
    bind: `host:port`; port 0 picks a free port (see `ServerHandle.port`).
    token: the run's shared token; every call must carry it.
    tls: serve TLS (and mutual TLS if `tls.client_ca`); None = plaintext.
    limits: message sizes, push size, rate limits, long-poll cap.
    fingerprint: the run fingerprint; if given, Pull/Heartbeat/Leave must carry it too (Join and Push are
      checked by the core).
    max_workers: threads serving calls; a quarter may serve Pushes and a half Pulls (`gate.SyncerGate`).
    allow_remote: permit a non-loopback bind.
    data_plane: also serve Push and Pull payloads on a raw-TCP port of the same host
      (`syncer/server/dataplane.py`), which Join tells learners; gRPC stays the control plane and the fallback.
  """
  check_bind(bind, allow_remote=allow_remote, tls=tls)
  if max_workers < 4:
    raise ValueError(f"max_workers must be >= 4 (pushes, pulls and control calls each need threads), got "
                     f"{max_workers}")
  limits = limits or Limits.defaults()
  gate = SyncerGate(core, limits, fingerprint, max_workers=max_workers)
  servicer = SyncerServicer(gate)
  options = [
      ("grpc.max_receive_message_length", limits.max_message_bytes),
      ("grpc.max_send_message_length", limits.max_message_bytes),
      ("grpc.so_reuseport", 0),  # two syncers on one port is a mistake, not load balancing
      ("grpc.max_concurrent_streams", 256),  # calls per connection (a learner needs a handful)
  ]
  server = grpc.server(
      concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="syncer-rpc"),
      interceptors=[AuthInterceptor(token, lambda: gate.count("refused_unauthenticated"))],
      options=options,
      # Calls accepted at once (queued or running). The slots refuse long calls over their caps at once,
      # so this only bounds the queue's memory: a burst of refused calls must not crowd out a heartbeat.
      maximum_concurrent_rpcs=64 * max_workers,
  )
  servicer.register(server)
  if tls is not None:
    port = server.add_secure_port(bind, tls.credentials())
  else:
    port = server.add_insecure_port(bind)
  if port == 0:
    raise OSError(f"could not bind {bind!r}")
  server.start()
  plane = None
  if data_plane:
    plane = DataPlaneServer(gate, token, bind.rsplit(":", 1)[0].strip("[]") or "127.0.0.1", tls=tls,
                            limits=DataPlaneLimits.from_service(limits))
    gate.data_port = plane.port
  log.info("syncer serving on %s (port %d, %s)%s", bind, port, "TLS" if tls else "plaintext",
           f", data plane on port {plane.port}" if plane else "")
  return ServerHandle(server=server, port=port, gate=gate, servicer=servicer, data_plane=plane)
