"""Who may talk to the syncer: the run token, TLS / mutual TLS, and where the service may listen.

* Every call must carry `authorization: Bearer <token>` (the run's shared token), compared in constant
  time by `AuthInterceptor` before any servicer code runs. The token itself is read with
  `protocol.run_token.read_token` (a file or $DILOCO_TOKEN, never a command line).
* `TlsConfig`: server TLS, and with `client_ca` mutual TLS.
* The service binds loopback only unless explicitly allowed (`check_bind`).
Per-caller call rates are limited by the service's gate (`gate.py`) with `ratelimit.RateLimiter`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import pathlib
from collections.abc import Callable

import grpc

from diloco_jax.protocol.reasons import REASON_METADATA_KEY, Reason

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TlsConfig:
  """Server TLS: PEM files. With `client_ca`, clients must present a certificate it signed (mutual TLS)."""

  cert: str
  key: str
  client_ca: str | None = None

  def credentials(self) -> grpc.ServerCredentials:
    key, cert = pathlib.Path(self.key).read_bytes(), pathlib.Path(self.cert).read_bytes()
    ca = pathlib.Path(self.client_ca).read_bytes() if self.client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


class AuthInterceptor(grpc.ServerInterceptor):
  """Refuses every call that lacks the run token, before any servicer code runs."""

  def __init__(self, token: str, on_refusal: Callable[[], None] = lambda: None):
    if not token:
      raise ValueError("the syncer needs a non-empty run token")
    self._expected = f"Bearer {token}".encode()
    self._on_refusal = on_refusal

  def intercept_service(self, continuation, handler_call_details):
    got = None
    for key, value in handler_call_details.invocation_metadata or ():
      if key == "authorization":
        got = value.encode() if isinstance(value, str) else value
    handler = continuation(handler_call_details)
    if got is not None and hmac.compare_digest(got, self._expected):
      return handler
    if handler is None:
      return None  # unknown method: gRPC answers UNIMPLEMENTED
    self._on_refusal()
    message = ("missing run token (metadata 'authorization: Bearer <token>')" if got is None
               else "invalid run token")

    def refuse(request, context):
      context.set_trailing_metadata(((REASON_METADATA_KEY, Reason.UNAUTHENTICATED.value),))
      context.abort(grpc.StatusCode[Reason.UNAUTHENTICATED.status], message)

    if handler.request_streaming and handler.response_streaming:
      return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
      return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
      return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


TOKEN_IDENTITY = "token"  # the identity of a caller that proved only the run token (no client certificate)


def identity_of(certificate: bytes | None) -> str:
  """A caller's authenticated identity: the digest of its client certificate (mutual TLS, DER or PEM bytes),
  else the run token's holder. Rate limits and slots are keyed by it (`gate.py`)."""
  if not certificate:
    return TOKEN_IDENTITY
  return "cert:" + hashlib.sha256(certificate).hexdigest()[:32]


def grpc_identity(context) -> str:
  """`identity_of` the client certificate a gRPC call's connection presented."""
  certs = context.auth_context().get("x509_pem_cert") or ()
  return identity_of(certs[0] if certs else None)


def is_loopback(bind: str) -> bool:
  """Whether `host:port` (or `[v6]:port`) binds a loopback address only."""
  host = bind.rsplit(":", 1)[0].strip("[]")
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False  # a hostname or a wildcard: may be reachable from outside


def check_bind(bind: str, *, allow_remote: bool, tls: TlsConfig | None) -> None:
  """Raise ValueError for a non-loopback `bind` unless `allow_remote`; warn when that runs without TLS."""
  if is_loopback(bind):
    return
  if not allow_remote:
    raise ValueError(f"refusing to bind {bind!r}: not a loopback address (pass --allow-remote to serve "
                     "other hosts, preferably with TLS)")
  if tls is None:
    log.warning("serving %s without TLS: the run token and fragments cross the network in clear", bind)
