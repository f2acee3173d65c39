"""The gRPC front-end of the syncer service: each method translates its protobuf request to a call of the
gate (`gate.py`, through `protocol.convert`), and the answer back.

* Chunking: fragments travel as a header message plus chunks, so any size passes under the per-message
  limit; Push payloads are reassembled from what arrived (`protocol.chunking.Reassembler`), never allocated
  from the declared size.
* Refusals: the gate's `GateRefusal`, the core's `Rejected`, a full slot (`Busy`) and a broken chunk stream
  (`ProtocolError`, a malformed request whatever rule it broke) are answered with the status code of their
  `Reason`, the reason in the `diloco-reason` trailing metadata. A bad call never crashes the server.
* Threads: Push streams and Pulls (their long-poll and their chunk stream) need one of the gate's slots: at
  most `max_workers // 4` Pushes and `max_workers // 2` Pulls at once, per caller `Limits.pulls_per_caller`
  Pulls and per connection `Limits.pushes_per_caller` Pushes (a Push's slot is taken before its header,
  which names the learner, arrives). A call over its cap is refused at once (RESOURCE_EXHAUSTED, retried by
  the client), so at least a quarter of the threads always serve Join, Heartbeat, Leave and Status.
* Streams: the stream watch (`watch.py`) cuts stalled and overlong streams (counted as "streams_cut").
"""

from __future__ import annotations

import functools
import logging
import time

import grpc

from diloco_jax.protocol import convert
from diloco_jax.protocol.chunking import ProtocolError, Reassembler
from diloco_jax.protocol.proto import diloco_pb2_grpc as pb_grpc
from diloco_jax.protocol.reasons import REASON_METADATA_KEY, Reason, Rejected, shorten, status_of
from diloco_jax.syncer.server.auth import grpc_identity
from diloco_jax.syncer.server.gate import GateRefusal, SyncerGate
from diloco_jax.syncer.server.slots import Busy
from diloco_jax.syncer.server.watch import Stream, StreamWatch

log = logging.getLogger(__name__)

# Refusals that a busy or flooded server answers many times a second: counted, logged at debug level only
# (a learner refused again and again for merge safety is logged once by the core, `admission.REPEATED_REFUSALS`).
_QUIET_REASONS = (Reason.RATE_LIMIT, Reason.BUSY, Reason.ROUND_SHARE, Reason.LEARNER_ID)


def _refusal(e: Exception) -> tuple[str, str, str] | None:
  """(status code name, message, reason) of a refusal; None for anything else."""
  if isinstance(e, GateRefusal):
    return e.reason.status, e.message, e.reason
  if isinstance(e, Busy):
    return e.reason.status, str(e), e.reason
  if isinstance(e, ProtocolError):  # a broken stream is a malformed request, whichever rule it broke
    return Reason.PROTOCOL.status, str(e), e.reason
  if isinstance(e, Rejected):
    return status_of(e.reason), f"rejected ({e.reason}): {e.message}", e.reason
  return None


def _rpc(stream: bool = False):
  """Run a servicer method; turn refusals and unexpected errors into a status (the server stays up).

  `stream`: the method answers with a stream (an empty one when the client went away); else its empty
  unary response is answered then (returning None would make gRPC log a serialization traceback).
  """

  def decorate(method):
    @functools.wraps(method)
    def wrapper(self, request, context):
      name = method.__name__
      try:
        return method(self, request, context)
      except Exception as e:  # a refusal, or a bug or an unexpected input: answer it, keep serving
        refusal = _refusal(e)
        if refusal is not None:
          code, message, reason = refusal
        elif not context.is_active():
          code, message, reason = Reason.CANCELLED.status, "", Reason.CANCELLED
        else:
          log.exception("%s failed", name)
          code, reason = Reason.INTERNAL.status, Reason.INTERNAL
          message = f"{name} failed: {type(e).__name__}: {shorten(str(e), 200)}"
      if not context.is_active():
        # The client went away (or the stream watch cut it): nobody to answer, nothing worth a traceback.
        self.gate.count("client_gone")
        log.debug("%s: client gone (%s %s)", name, code, message)
        return iter(()) if stream else convert.empty_response(name)
      self.gate.count(f"refused_{code.lower()}")
      log.log(logging.DEBUG if reason in _QUIET_REASONS else logging.INFO, "%s refused: %s %s", name, code,
              message)
      context.set_trailing_metadata(((REASON_METADATA_KEY, str(reason)),))
      context.abort(grpc.StatusCode[code], message)

    return wrapper

  return decorate


class SyncerServicer(pb_grpc.SyncerServicer):
  """The gRPC methods, each a translation to one call of the gate."""

  def __init__(self, gate: SyncerGate):
    self.gate = gate
    limits = gate.limits
    self._watch = StreamWatch(limits.stream_stall_s, limits.stream_deadline_s, lambda: gate.count("streams_cut"))

  def register(self, server: grpc.Server) -> None:
    """Serve the Syncer service's methods on `server`."""
    pb_grpc.add_SyncerServicer_to_server(self, server)

  def close(self) -> None:
    """Stop the stream watch (the server has stopped)."""
    self._watch.stop()

  @staticmethod
  def _caller(context, learner_id):
    """Who is calling: its source, the authenticated identity and the connection's peer address (set by
    the transport and the authentication, not the request), and the learner id the request claims."""
    return (grpc_identity(context), context.peer()), learner_id

  @_rpc()
  def Join(self, request, context):
    versions = self.gate.join(self._caller(context, request.learner_id), request.learner_id, request.fingerprint)
    return convert.join_response(versions, self.gate.data_port)

  @_rpc()
  def Leave(self, request, context):
    self.gate.leave(self._caller(context, request.learner_id), request.learner_id, request.fingerprint)
    return convert.leave_response()

  @_rpc()
  def Heartbeat(self, request, context):
    call = convert.heartbeat_call(request)
    return convert.heartbeat_response(self.gate.heartbeat(self._caller(context, call.learner_id), call))

  @_rpc()
  def Status(self, request, context):
    return convert.status_response(self.gate.status(self._caller(context, "status")))

  @_rpc()
  def Push(self, request_iterator, context):
    # The slot is the connection's (its header, with the claimed id, has not arrived yet): a stream
    # that stalls before its header holds a slot too, never a thread beyond the push quota.
    connection = self._caller(context, "push")[0]
    self.gate.push_slots.acquire(connection)
    stream = self._watch.watch(context)
    try:
      return convert.receipt_response(self._push(request_iterator, context, stream))
    finally:
      self._watch.done(stream)
      self.gate.push_slots.release(connection)

  def _push(self, request_iterator, context, stream: Stream):
    first = next(request_iterator, None)
    if stream.cut:
      raise GateRefusal(Reason.STALLED, f"Push stream cut: {stream.cut}")
    if first is None or first.WhichOneof("kind") != "header":
      raise GateRefusal(Reason.PROTOCOL, "a Push stream must start with a header message")
    header = first.header
    self.gate.check_push(self._caller(context, header.learner_id), int(header.total_size))
    payload = Reassembler(int(header.total_size), "push payload")
    stream.progress()  # the header counts: the stall clock of the payload starts now
    for msg in request_iterator:
      if msg.WhichOneof("kind") != "data":
        raise GateRefusal(Reason.PROTOCOL, "a second header in one Push stream")
      payload.add(msg.offset, msg.data)
      if msg.data:  # only bytes are progress: empty chunks do not keep a stream alive
        stream.progress()
    if stream.cut:
      raise GateRefusal(Reason.STALLED, f"Push stream cut: {stream.cut}")
    return self.gate.push(convert.push_from(header, payload.finish()))

  @_rpc(stream=True)
  def Pull(self, request, context):
    call = convert.pull_call(request)
    caller = self._caller(context, call.learner_id)
    timeout = self.gate.open_pull(caller, call)
    remaining = context.time_remaining()
    if remaining is not None:
      timeout = min(timeout, max(0.0, remaining - 0.05))  # answer "not found" before the client gives up
    deadline = time.monotonic() + timeout
    published = self.gate.pull(call)
    if published is None and timeout <= 0:
      return convert.not_found_chunks(call.fragment, self.gate.epoch)
    # The slot is held through the long-poll wait and the chunk stream (released when the stream ends).
    self.gate.pull_slots.acquire(caller[0])
    stream = self._watch.watch(context)
    try:
      stream.waiting = True
      # Long-poll in slices so that a client that went away frees its worker thread within a second.
      if published is None:
        published = self.gate.long_poll(call, deadline, 1.0, lambda: not context.is_active())
      stream.restart()
    except BaseException:
      self._watch.done(stream)
      self.gate.pull_slots.release(caller[0])
      raise
    if published is None:
      answer = convert.not_found_chunks(call.fragment, self.gate.epoch)
    else:
      self.gate.pulled(published)
      answer = self._pull_chunks(published, stream)
    return self._released(answer, stream, caller[0])

  def _released(self, messages, stream: Stream, source):
    """Yield `messages`, then free the Pull's slot and watch (also when the client goes away)."""
    try:
      yield from messages
    finally:
      self._watch.done(stream)
      self.gate.pull_slots.release(source)

  def _pull_chunks(self, published, stream: Stream):
    for k, message in enumerate(convert.pull_chunks(published, self.gate.limits.chunk_bytes)):
      yield message
      if k:  # a data chunk: gRPC asks for the next message once this one is on its way
        stream.progress()
