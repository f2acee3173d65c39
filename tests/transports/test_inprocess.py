"""The in-process transport: learners on threads against one core."""

import threading

import numpy as np

import helpers
from diloco_jax.outer import codec
from diloco_jax.protocol.interfaces import Transport
from diloco_jax.protocol.messages import Push
from diloco_jax.syncer import core as core_lib
from diloco_jax.transports.inprocess import InProcessTransport

FP = helpers.FP


def test_in_process_transport_two_threads():
  # Deltas far above the zero fragments' norm: the outlier bound (test_merge_safety's subject) off.
  settings = helpers.syncer_settings((40, 24), codec="int8", downlink_codec="bf16", block=8, min_quorum=2,
                                     max_grace_s=5.0, num_learners=2, max_norm_ratio=0.0)
  core = core_lib.SyncerCore(settings, [np.zeros(40, np.float32), np.zeros(24, np.float32)])
  results, errors = {}, []
  barrier = threading.Barrier(2)

  def learner(i):
    try:
      t = InProcessTransport(core)
      assert isinstance(t, Transport)
      assert t.join(i, FP).versions == {0: 0, 1: 0}
      barrier.wait()  # both joined: the round waits for both
      t.heartbeat(i, 0.1)
      sent = 0
      for p, n in ((0, 40), (1, 24)):
        payload = codec.encode(np.full(n, i + 1.0, np.float32), "int8", 8)
        t.push(Push(i, FP, p, 0, 5, 50, "int8", payload, codec.checksum(payload)))
        sent += len(payload)
      # Both hold the version-0 reference: the answers are bf16 deltas from it.
      pulled = [t.pull(p, 1, timeout_s=10.0, have_version=0) for p in range(2)]
      results[i] = (t.bytes_sent, sent, t.bytes_received, sum(len(x.payload) for x in pulled), pulled)
    except Exception as e:  # noqa: BLE001 - surfaced below
      errors.append(e)

  threads = [threading.Thread(target=learner, args=(i,)) for i in range(2)]
  for th in threads:
    th.start()
  for th in threads:
    th.join(30)
  assert not errors, errors
  for i in range(2):
    bytes_sent, sent, bytes_received, received, pulled = results[i]
    assert bytes_sent == sent == codec.encoded_size(40, "int8", 8) + codec.encoded_size(24, "int8", 8)
    assert bytes_received == received == 2 * 40 + 2 * 24
    assert [x.version for x in pulled] == [1, 1]
    assert [(x.kind, x.base_version) for x in pulled] == [("delta", 0), ("delta", 0)]
    # Both contributions merged (equal tokens): the mean delta is 1.5, lr 0.7 from zero momentum; the
    # initial fragment is zero, so the delta is the new fragment.
    got = codec.decode(pulled[0].payload, "bf16", 40)
    np.testing.assert_allclose(got, -0.7 * (1.5 + 0.9 * 1.5), rtol=1e-2)
  assert core.counters["bytes_in"] == 2 * results[0][1]
  assert core.counters["bytes_out"] == results[0][3] + results[1][3]
