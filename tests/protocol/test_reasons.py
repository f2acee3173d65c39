"""Refusal reasons: one enum, each with its status code."""


import grpc

from diloco_jax.protocol.reasons import REASONS, REJOIN_REASONS, Reason, Rejected, status_of


def test_every_reason_has_a_status_code_and_every_core_reason_is_a_reason():
  for reason in Reason:
    assert isinstance(grpc.StatusCode[reason.status], grpc.StatusCode), reason
    assert isinstance(reason, str) and reason == reason.value and status_of(reason.value) == reason.status
  assert REASONS and all(isinstance(r, str) and Reason(r).by_core for r in REASONS)
  assert set(REASONS) == {r.value for r in Reason if r.by_core} and len(set(REASONS)) == len(REASONS)
  assert set(REJOIN_REASONS) <= set(REASONS)
  assert status_of("not a reason") == "INVALID_ARGUMENT"
  # A reason compares, hashes and prints as its string: counters keyed by reason strings keep working.
  e = Rejected("outlier", "too large")
  assert e.reason is Reason.OUTLIER and e.reason == "outlier" and {"outlier": 1}[e.reason] == 1
  assert str(e) == "outlier: too large" and f"{e.reason}" == "outlier"
