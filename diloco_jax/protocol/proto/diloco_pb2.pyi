from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JoinRequest(_message.Message):
    __slots__ = ("learner_id", "fingerprint")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    learner_id: int
    fingerprint: str
    def __init__(self, learner_id: _Optional[int] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("versions", "data_port", "epoch", "history")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.ScalarMap[int, int]
    data_port: int
    epoch: int
    history: _containers.RepeatedCompositeFieldContainer[Lifetime]
    def __init__(self, versions: _Optional[_Mapping[int, int]] = ..., data_port: _Optional[int] = ..., epoch: _Optional[int] = ..., history: _Optional[_Iterable[_Union[Lifetime, _Mapping]]] = ...) -> None: ...

class Lifetime(_message.Message):
    __slots__ = ("epoch", "start_rounds", "version_offsets")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    start_rounds: _containers.RepeatedScalarFieldContainer[int]
    version_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[int] = ..., start_rounds: _Optional[_Iterable[int]] = ..., version_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("learner_id", "fingerprint")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    learner_id: int
    fingerprint: str
    def __init__(self, learner_id: _Optional[int] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("learner_id", "fingerprint", "fragment", "base_version", "steps", "tokens", "codec", "checksum", "total_size", "incarnation", "sequence", "base_epoch")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    learner_id: int
    fingerprint: str
    fragment: int
    base_version: int
    steps: int
    tokens: int
    codec: str
    checksum: int
    total_size: int
    incarnation: int
    sequence: int
    base_epoch: int
    def __init__(self, learner_id: _Optional[int] = ..., fingerprint: _Optional[str] = ..., fragment: _Optional[int] = ..., base_version: _Optional[int] = ..., steps: _Optional[int] = ..., tokens: _Optional[int] = ..., codec: _Optional[str] = ..., checksum: _Optional[int] = ..., total_size: _Optional[int] = ..., incarnation: _Optional[int] = ..., sequence: _Optional[int] = ..., base_epoch: _Optional[int] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data", "offset")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    offset: int
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("fragment", "round", "late", "epoch", "version", "phase_s")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASE_S_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    round: int
    late: bool
    epoch: int
    version: int
    phase_s: float
    def __init__(self, fragment: _Optional[int] = ..., round: _Optional[int] = ..., late: _Optional[bool] = ..., epoch: _Optional[int] = ..., version: _Optional[int] = ..., phase_s: _Optional[float] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("learner_id", "fingerprint", "fragment", "min_version", "timeout_s", "have_version", "have_epoch")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    HAVE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    learner_id: int
    fingerprint: str
    fragment: int
    min_version: int
    timeout_s: float
    have_version: int
    have_epoch: int
    def __init__(self, learner_id: _Optional[int] = ..., fingerprint: _Optional[str] = ..., fragment: _Optional[int] = ..., min_version: _Optional[int] = ..., timeout_s: _Optional[float] = ..., have_version: _Optional[int] = ..., have_epoch: _Optional[int] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("found", "fragment", "version", "codec", "checksum", "total_size", "kind", "base_version", "epoch")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    found: bool
    fragment: int
    version: int
    codec: str
    checksum: int
    total_size: int
    kind: str
    base_version: int
    epoch: int
    def __init__(self, found: _Optional[bool] = ..., fragment: _Optional[int] = ..., version: _Optional[int] = ..., codec: _Optional[str] = ..., checksum: _Optional[int] = ..., total_size: _Optional[int] = ..., kind: _Optional[str] = ..., base_version: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("header", "data", "offset")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    data: bytes
    offset: int
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("learner_id", "fingerprint", "step_time_s", "step", "blocked")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_FIELD_NUMBER: _ClassVar[int]
    learner_id: int
    fingerprint: str
    step_time_s: float
    step: int
    blocked: bool
    def __init__(self, learner_id: _Optional[int] = ..., fingerprint: _Optional[str] = ..., step_time_s: _Optional[float] = ..., step: _Optional[int] = ..., blocked: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...
