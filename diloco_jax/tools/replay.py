"""`python -m diloco_jax replay --tape PATH`: replay a recorded syncer tape and check it bit for bit.

Each segment of the tape (one syncer lifetime, `syncer --record-tape`) is fed through a fresh `SyncerCore`
built from the segment's settings, epoch and initial fragments, with a clock that returns the readings the
recorded core took: every step must give the recorded outcome (result or refusal, decision records, the
CRC-32 of every new global fragment), and a segment that ended cleanly the recorded digest of every global
fragment and momentum. A mismatch means the core's decisions depend on something the tape does not hold (a
rule hidden in the shell, a clock read outside a step, a random draw): the first one is printed.
"""

from __future__ import annotations

import collections
import dataclasses

from absl import flags

from diloco_jax import cli
from diloco_jax.syncer import tape as tape_lib
from diloco_jax.syncer.core import SyncerCore


class ReplayClock:
  """A clock that returns the readings of the step being replayed, in order."""

  def __init__(self):
    self._readings: collections.deque[float] = collections.deque()

  def load(self, readings) -> None:
    self._readings = collections.deque(readings)

  @property
  def left(self) -> int:
    return len(self._readings)

  def __call__(self) -> float:
    if not self._readings:
      raise RuntimeError("the replayed step read the clock more often than the recorded one")
    return self._readings.popleft()


@dataclasses.dataclass
class Segment:
  """One syncer lifetime of a tape, replayed."""

  steps: int = 0
  ended: bool = False  # it ended with a digest (a clean stop)
  mismatch: str | None = None  # the first difference from the recording


def replay(path) -> list[Segment]:
  """Replay every segment of the tape at `path` (see the module docstring)."""
  segments: list[Segment] = []
  core = clock = None
  for step in tape_lib.read(path):
    if step.kind == "begin":
      clock = ReplayClock()
      clock.load([step.record["started"]])
      core = SyncerCore(tape_lib.settings_from(step.record), step.args["fragments"], clock,
                        epoch=step.record["epoch"])
      segments.append(Segment())
      continue
    segment = segments[-1]
    if segment.mismatch is not None:
      continue  # the state diverged: later steps say nothing more
    if step.kind == "end":
      segment.ended = True
      if not tape_lib.same(core.digest(), step.record["digest"]):
        segment.mismatch = f"final digest {core.digest()} != recorded {step.record['digest']}"
      continue
    clock.load(step.reads)
    outcome = core.apply(step.kind, step.args)
    segment.steps += 1
    if clock.left:
      outcome = {**outcome, "unread_clock_readings": clock.left}
    if not tape_lib.same(outcome, step.record["outcome"]):
      segment.mismatch = (f"step {segment.steps} ({step.kind}): replayed {tape_lib._json(outcome)[:2000]} != "
                          f"recorded {tape_lib._json(step.record['outcome'])[:2000]}")
  return segments


def _define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("tape", None, "the tape file a syncer wrote (--record-tape)", flag_values=fv)


def replay_tape(argv) -> int:
  """`python -m diloco_jax replay --tape PATH`; see the module docstring."""
  fv = cli.parse(argv, _define_flags, __doc__, config=False)
  if not fv.tape:
    raise cli.UsageError("--tape is required")
  segments = replay(fv.tape)
  if not segments:
    raise cli.UsageError(f"--tape: {fv.tape} holds no syncer segment")
  for i, s in enumerate(segments):
    state = "ended cleanly, digest checked" if s.ended else "no clean end (killed, or still running)"
    verdict = "identical" if s.mismatch is None else f"DIFFERS: {s.mismatch}"
    print(f"segment {i}: {s.steps} steps replayed, {state}: {verdict}")
  bad = sum(s.mismatch is not None for s in segments)
  print(f"replay: {len(segments)} segment(s), {'all identical' if not bad else f'{bad} differ'}")
  return 1 if bad else 0

