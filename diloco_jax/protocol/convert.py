"""The protocol's messages to and from their protobuf form (`proto/diloco.proto`): the only module that reads
or builds the generated messages, for both planes (gRPC calls, and the data plane's headers and replies).

Client side: `*_request` builds a request, `*_from` reads an answer. Service side: `*_call` (or `push_from`)
reads a request, `*_response` / `*_header` builds an answer. Streams: `push_chunks` and `pull_chunks` cut a
payload into the header message and the data chunks that follow it (`chunking.chunks`). A full fragment's
PullHeader leaves `kind` and `base_version` unset (fewer bytes); a learner that says nothing of what it
holds (unset `have_version`) gets the full fragment.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from diloco_jax.protocol.chunking import chunks
from diloco_jax.protocol.messages import (
  EpochRecord,
  HeartbeatCall,
  Kind,
  Published,
  PullCall,
  Push,
  PushReceipt,
  Versions,
)
from diloco_jax.protocol.proto import diloco_pb2 as pb

# ---- Join, Leave, Heartbeat, Status ---------------------------------------------------------------------


def empty_response(method: str):
  """The empty answer of the unary gRPC method named `method` ("Join": a JoinResponse()): what a call
  whose client went away is answered (returning None would make gRPC log a serialization traceback)."""
  return getattr(pb, f"{method}Response")()


def join_request(learner_id: int, fingerprint: str) -> pb.JoinRequest:
  return pb.JoinRequest(learner_id=learner_id, fingerprint=fingerprint)


def join_response(versions: Versions, data_port: int) -> pb.JoinResponse:
  """A join's answer, telling the data plane's port (0: none)."""
  history = [pb.Lifetime(epoch=h.epoch, start_rounds=h.start_rounds, version_offsets=h.version_offsets)
             for h in versions.history]
  return pb.JoinResponse(versions={int(k): int(v) for k, v in versions.versions.items()}, data_port=data_port,
                         epoch=versions.epoch, history=history)


def versions_from(response: pb.JoinResponse) -> Versions:
  history = tuple(EpochRecord(int(h.epoch), tuple(int(x) for x in h.start_rounds),
                              tuple(int(x) for x in h.version_offsets)) for h in response.history)
  return Versions({int(k): int(v) for k, v in response.versions.items()}, epoch=int(response.epoch),
                  history=history)


def leave_request(learner_id: int, fingerprint: str) -> pb.LeaveRequest:
  return pb.LeaveRequest(learner_id=learner_id, fingerprint=fingerprint)


def leave_response() -> pb.LeaveResponse:
  return pb.LeaveResponse()


def heartbeat_request(learner_id: int, fingerprint: str, step_time_s: float, step: int | None,
                      blocked: bool) -> pb.HeartbeatRequest:
  request = pb.HeartbeatRequest(learner_id=learner_id, fingerprint=fingerprint, step_time_s=float(step_time_s),
                                blocked=bool(blocked))
  if step is not None:  # unset: unknown
    request.step = int(step)
  return request


def heartbeat_call(request: pb.HeartbeatRequest) -> HeartbeatCall:
  return HeartbeatCall(learner_id=request.learner_id, fingerprint=request.fingerprint,
                       step_time_s=float(request.step_time_s),
                       step=request.step if request.HasField("step") else None, blocked=bool(request.blocked))


def heartbeat_response(epoch: int | None) -> pb.HeartbeatResponse:
  return pb.HeartbeatResponse(epoch=int(epoch or 0))


def epoch_from(response: pb.HeartbeatResponse) -> int:
  return int(response.epoch)


def status_request() -> pb.StatusRequest:
  return pb.StatusRequest()


def status_response(status: dict) -> pb.StatusResponse:
  return pb.StatusResponse(json=json.dumps(status, default=str))


def status_from(response: pb.StatusResponse) -> dict:
  return json.loads(response.json)


# ---- Push -------------------------------------------------------------------------------------------------


def push_header(push: Push) -> pb.PushHeader:
  """Everything of `push` but its payload, whose size it declares (a gRPC stream's first message, the data
  plane's request header)."""
  return pb.PushHeader(learner_id=push.learner_id, fingerprint=push.fingerprint, fragment=push.fragment,
                       base_version=push.base_version, steps=push.steps, tokens=push.tokens, codec=push.codec,
                       checksum=push.checksum, total_size=len(push.payload), incarnation=push.incarnation,
                       sequence=push.sequence, base_epoch=push.base_epoch)


def push_chunks(header: pb.PushHeader, payload, chunk_bytes: int) -> Iterator[pb.PushChunk]:
  """A Push stream: the header, then the payload in chunks of at most `chunk_bytes`."""
  yield pb.PushChunk(header=header)
  for offset, data in chunks(payload, chunk_bytes):
    yield pb.PushChunk(data=data, offset=offset)


def parse_push_header(data: bytes) -> pb.PushHeader:
  """A data-plane push's header (`google.protobuf.message.DecodeError` if unreadable)."""
  return pb.PushHeader.FromString(data)


def push_from(header: pb.PushHeader, payload) -> Push:
  """The push a header and its reassembled payload make."""
  h = header
  return Push(learner_id=h.learner_id, fingerprint=h.fingerprint, fragment=h.fragment, base_version=h.base_version,
              steps=h.steps, tokens=h.tokens, codec=h.codec, payload=payload, checksum=h.checksum,
              incarnation=h.incarnation, sequence=h.sequence, base_epoch=h.base_epoch)


def receipt_response(receipt: PushReceipt) -> pb.PushResponse:
  return pb.PushResponse(fragment=receipt.fragment, round=receipt.round, late=receipt.late, epoch=receipt.epoch,
                         version=receipt.version, phase_s=receipt.phase_s)


def receipt_from(response: pb.PushResponse) -> PushReceipt:
  r = response
  return PushReceipt(fragment=r.fragment, round=r.round, late=r.late, epoch=int(r.epoch), version=r.version,
                     phase_s=float(r.phase_s))


def parse_receipt(data: bytes) -> PushReceipt:
  """A data-plane push's reply body."""
  return receipt_from(pb.PushResponse.FromString(data))


# ---- Pull -------------------------------------------------------------------------------------------------


def pull_request(learner_id: int, fingerprint: str, fragment: int, min_version: int, timeout_s: float,
                 have_version: int = -1, have_epoch: int = 0) -> pb.PullRequest:
  request = pb.PullRequest(learner_id=learner_id, fingerprint=fingerprint, fragment=fragment,
                           min_version=min_version, timeout_s=float(timeout_s))
  if have_version >= 0:  # unset means "nothing usable": a full answer
    request.have_version = have_version
    request.have_epoch = have_epoch
  return request


def pull_call(request: pb.PullRequest) -> PullCall:
  r = request
  return PullCall(learner_id=r.learner_id, fingerprint=r.fingerprint, fragment=r.fragment,
                  min_version=r.min_version, timeout_s=float(r.timeout_s),
                  have_version=r.have_version if r.HasField("have_version") else -1,
                  have_epoch=r.have_epoch if r.HasField("have_epoch") else 0)


def parse_pull_call(data: bytes) -> PullCall:
  """A data-plane pull's request header (`google.protobuf.message.DecodeError` if unreadable)."""
  return pull_call(pb.PullRequest.FromString(data))


def pull_header(published: Published) -> pb.PullHeader:
  """The header of a found fragment; its payload follows."""
  header = pb.PullHeader(found=True, fragment=published.fragment, version=published.version,
                         codec=published.codec, checksum=published.checksum, total_size=len(published.payload),
                         epoch=published.epoch)
  if published.kind == Kind.DELTA:  # a full answer leaves both unset (fewer bytes)
    header.kind, header.base_version = Kind.DELTA.value, published.base_version
  return header


def not_found_header(fragment: int, epoch: int) -> pb.PullHeader:
  """No version >= min_version within the timeout; nothing follows."""
  return pb.PullHeader(found=False, fragment=fragment, epoch=epoch)


def pull_chunks(published: Published, chunk_bytes: int) -> Iterator[pb.PullChunk]:
  """A Pull stream's answer: the header, then the payload in chunks of at most `chunk_bytes`."""
  yield pb.PullChunk(header=pull_header(published))
  for offset, data in chunks(published.payload, chunk_bytes):
    yield pb.PullChunk(data=data, offset=offset)


def not_found_chunks(fragment: int, epoch: int) -> Iterator[pb.PullChunk]:
  return iter([pb.PullChunk(header=not_found_header(fragment, epoch))])


def parse_pull_header(data: bytes) -> pb.PullHeader:
  """A data-plane pull's reply body."""
  return pb.PullHeader.FromString(data)


def pulled_kind(header: pb.PullHeader) -> Kind | None:
  """The kind a PullHeader declares ("" is full); None for a kind this client does not know."""
  return {"": Kind.FULL, "full": Kind.FULL, "delta": Kind.DELTA}.get(header.kind)


def published_from(header: pb.PullHeader, payload) -> Published:
  """The fragment a found PullHeader and its payload make."""
  h = header
  if pulled_kind(h) == Kind.DELTA:
    return Published(fragment=h.fragment, version=h.version, codec=h.codec, payload=payload, checksum=h.checksum,
                     kind=Kind.DELTA, base_version=h.base_version, epoch=h.epoch)
  return Published(fragment=h.fragment, version=h.version, codec=h.codec, payload=payload, checksum=h.checksum,
                   epoch=h.epoch)
