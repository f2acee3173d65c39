"""One process of a 2-process jax.distributed group for test_multihost.py:

    python tests/multihost_worker.py PROCESS_ID PORT OUT_DIR

Checks the pieces a multi-host learner is made of, on 2 processes x 2 fake CPU devices, and writes what
it saw to OUT_DIR/p<PROCESS_ID>.json for the test to assert on.
"""

import json
import os
import sys
import time

process_id, port, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from diloco_jax.compute import mesh as mesh_lib  # noqa: E402
from diloco_jax.compute import multihost  # noqa: E402

spec = multihost.DistributedSpec(f"127.0.0.1:{port}", 2, process_id)
spec.validate()
multihost.initialize(spec, peer_timeout_s=3.0, init_timeout_s=120)
out = {"process_count": jax.process_count(), "local_devices": jax.local_device_count()}

mesh = mesh_lib.make_mesh(jax.devices(), {"data": -1})
out["rows"] = list(mesh_lib.process_rows(mesh, 8))

# Broadcast: bit for bit, signed zeros, infinities, subnormals and a NaN payload included.
special = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -3.5, 2.0**100], np.float32)
nan_payload = np.array([0x7FC00123], np.uint32).view(np.float32)
source = np.concatenate([special, nan_payload, np.linspace(-1, 1, 1000, dtype=np.float32)])
broadcast = multihost.Broadcaster(mesh)
got = broadcast(source if process_id == 0 else None, source.size)
out["broadcast_replicated"] = bool(got.is_fully_replicated and got.sharding.mesh == mesh)
if process_id == 0:
  hlo = broadcast._fn.lower(  # pylint: disable=protected-access
      jax.ShapeDtypeStruct((4, source.size), np.uint32, sharding=broadcast._in)).compile().as_text()  # pylint: disable=protected-access
  out["broadcast_collectives"] = sorted({op for op in ("all-reduce", "all-gather", "all-to-all", "collective-permute")
                                         if f" {op}(" in hlo})
out["broadcast_bits_equal"] = bool(np.array_equal(np.asarray(multihost.local_replica(got)).view(np.uint32),
                                                  source.view(np.uint32)))
out["local_replica_shape"] = list(multihost.local_replica(got).shape)

# Host channel: numbered messages from process 0; the last reader deletes each.
lost = []
watch = multihost.PeerWatch(process_id, 2, timeout_s=3.0, beat_s=0.25, on_lost=lost.append).start()
channel = multihost.HostChannel(process_id, 2, watch=watch, poll_s=0.25)
if process_id == 0:
  for seq in range(3):
    channel.publish(seq, {"seq": seq, "adopt": [[0, seq + 1, "full", -1, 1, False]]})
else:
  out["received"] = [channel.receive(seq) for seq in range(3)]
client = multihost._client()  # pylint: disable=protected-access
client.wait_at_barrier("read", 60_000)
out["messages_left"] = client.key_value_dir_get("diloco/msg")

# The watch: process 0 stops beating without saying it is done (a hung process); process 1, waiting for
# a message that never comes, gets out through the watch's verdict instead of waiting forever.
if process_id == 0:
  watch.stop(done=False)
  time.sleep(8.0)
else:
  t0 = time.monotonic()
  try:
    channel.receive(99)
    out["receive_after_loss"] = "returned"
  except multihost.PeerLost as e:
    out["receive_after_loss"] = f"PeerLost: {e}"
  out["loss_detected_after_s"] = time.monotonic() - t0
  out["lost"] = lost
  watch.stop()
with open(os.path.join(out_dir, f"p{process_id}.json"), "w") as f:
  json.dump(out, f)
