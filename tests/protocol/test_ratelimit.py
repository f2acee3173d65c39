"""Token buckets on a fake clock: the bandwidth cap's debt arithmetic and the per-caller rate limits."""

import math

from diloco_jax.protocol.ratelimit import RateLimiter, TokenBucket


def test_token_bucket_reserve_goes_into_debt():
  now = [0.0]
  bucket = TokenBucket(rate=1000.0, burst=100.0, clock=lambda: now[0])
  assert bucket.reserve(100) == 0.0  # the burst
  assert math.isclose(bucket.reserve(500), 0.5)  # in debt: wait until it is paid
  assert math.isclose(bucket.reserve(500), 1.0)  # behind the bytes already reserved
  now[0] = 1.0
  assert math.isclose(bucket.reserve(0), 0.0)  # paid off by t=1: no wait for nothing
  now[0] = 10.0
  assert bucket.reserve(100) == 0.0  # refilled, but never above the burst
  assert math.isclose(bucket.reserve(100), 0.1)


def test_token_bucket_try_take_never_owes():
  now = [0.0]
  bucket = TokenBucket(rate=2.0, burst=2.0, clock=lambda: now[0])
  assert [bucket.try_take() for _ in range(3)] == [True, True, False]
  now[0] = 0.25  # half a token: still refused, and the refusal spent nothing
  assert not bucket.try_take()
  now[0] = 0.5
  assert bucket.try_take() and not bucket.try_take()


def test_rate_limiter_is_per_key_and_refills():
  now = [0.0]
  limiter = RateLimiter(2.0, 2, clock=lambda: now[0])
  assert [limiter.allow("a") for _ in range(3)] == [True, True, False]
  assert limiter.allow("b")
  now[0] += 0.5
  assert limiter.allow("a") and not limiter.allow("a")
  assert RateLimiter(0.0, 1).allow("anyone")  # 0 = unlimited


def test_rate_limiter_keeps_a_bounded_number_of_callers():
  now = [0.0]
  limiter = RateLimiter(1.0, 1, clock=lambda: now[0], max_keys=3)
  for key in range(100):  # a caller inventing keys
    assert limiter.allow(key)
  assert len(limiter._buckets) == 3
  assert not limiter.allow(99)  # the most recent keys keep their spent buckets
