"""The learner/syncer interfaces: both transports and the core implement them."""



import helpers
from diloco_jax.protocol import interfaces
from diloco_jax.transports.grpc_client import GrpcTransport
from diloco_jax.transports.inprocess import InProcessTransport


def test_both_transports_and_the_core_implement_the_interfaces():
  core = helpers.make_core((8,))
  assert isinstance(core, interfaces.SyncerAPI)
  assert isinstance(InProcessTransport(core), interfaces.Transport)
  t = GrpcTransport("127.0.0.1:1", "token", 0)
  try:
    assert isinstance(t, interfaces.Transport)
  finally:
    t.close()
