"""A hostile token holder against a real syncer process (issue 21; the fast cases against the in-process
service are tests/syncer/server/test_hostile_learners.py): 500 copies of one period into one open K = M
round leave the syncer's memory where it was, a legitimate learner's heartbeats stay under 0.5 s and its
push is merged at once; and the syncer's INFO lines reach its log."""

import dataclasses
import pathlib
import threading
import time

import pytest

import helpers
from diloco_jax.outer import codec as codec_lib
from diloco_jax.protocol.messages import Push
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.transports.grpc_client import GrpcTransport

pytestmark = pytest.mark.process

COPIES = 500  # the 532 copies grew the syncer by 29 MiB for as long as the round stayed open
HEARTBEAT_S = 0.5


def rss_mib(pid: int) -> float:
  for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
    if line.startswith("VmRSS:"):
      return int(line.split()[1]) / 1024
  raise AssertionError("no VmRSS")


def transport(run, learner_id, fingerprint):
  return GrpcTransport(f"127.0.0.1:{run.port}", helpers.PROCESS_TOKEN, learner_id, fingerprint=fingerprint,
                       unreachable_deadline_s=10.0, call_timeout_s=5.0)


def test_copies_into_an_open_round_leave_memory_and_the_others_service_alone(tmp_path):
  run = helpers.ProcessRun(tmp_path, helpers.tiny_overrides(**{
      "outer.min_quorum": 2, "outer.lease_s": 30.0, "outer.downlink_codec": "fp32", "outer.codec": "fp32"}))
  try:
    syncer = run.syncer()
    helpers.wait_for(lambda: " INFO " in run.log("syncer"), "an INFO line in the syncer's log", timeout=30)
    status = run.status()
    fp = status["fingerprint"]
    with transport(run, 1, fp) as victim, transport(run, 0, fp) as attacker:
      size = len(victim.pull(0, 0).payload) // 4  # fp32 downlink: the fragment's size
      victim.join(1, fp)
      attacker.join(0, fp)
      worst, beats, stop = [0.0], [0], threading.Event()

      def beat():
        while not stop.is_set():
          start = time.monotonic()
          victim.heartbeat(1, 2.0, step=beats[0])  # a 2 s step: counted through any pause of this process
          worst[0] = max(worst[0], time.monotonic() - start)
          beats[0] += 1
          stop.wait(0.05)

      def push_of(learner, seed, **kw):
        payload = codec_lib.encode(helpers.small_delta(size, 1e-4, seed), "fp32", 64)
        return Push(learner_id=learner, fingerprint=fp, fragment=0, base_version=0, steps=5, tokens=5, codec="fp32",
                    payload=payload, checksum=codec_lib.checksum(payload), **kw)

      beater = threading.Thread(target=beat, daemon=True)
      beater.start()
      before = rss_mib(syncer.pid)
      refused, copy = 0, push_of(0, 1)
      for seq in range(COPIES):
        if seq % 20 == 0:  # the attacker says it waits on the syncer: it stays counted, the round waits for all
          attacker.heartbeat(0, 0.05, step=0, blocked=True)
        try:
          attacker.push(dataclasses.replace(copy, incarnation=7, sequence=seq + 1))
        except Rejected as e:
          assert e.reason == "round_share"
          refused += 1
      grown = rss_mib(syncer.pid) - before
      st = run.status()
      assert refused == COPIES - 2 and st["versions"][0] == 0, st["counted"]  # the round waits for the victim
      start = time.monotonic()
      receipt = victim.push(push_of(1, 2, incarnation=8, sequence=1))
      assert victim.pull(0, receipt.version, timeout_s=10.0).version == receipt.version == 1
      push_s = time.monotonic() - start
      stop.set()
      beater.join(10)
    final = run.status()
  finally:
    run.kill_all()
  assert beats[0] >= 2 and worst[0] < HEARTBEAT_S, (beats, worst)
  assert push_s < 2.0
  assert grown < 8.0, grown
  assert final["counters"]["tokens_merged"] == 10 and final["counters"]["rejected"]["round_share"] == COPIES - 2
