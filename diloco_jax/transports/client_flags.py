"""The flags of a command that talks to a syncer as a client (`evaluator`, `status`): where it is, the run
token (from a file or $DILOCO_TOKEN, never from the command line) and TLS."""

from __future__ import annotations

from absl import flags

from diloco_jax import cli
from diloco_jax.protocol import run_token
from diloco_jax.transports import sharded


def define(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("syncer", None, "host:port of the syncer (a sharded syncer: one per shard, comma-separated, "
                      "in shard order)", flag_values=fv, required=True)
  flags.DEFINE_string("token-file", None, f"file holding the run token (else ${run_token.TOKEN_ENV})",
                      flag_values=fv)
  flags.DEFINE_string("tls-ca", None, "PEM CA that signed the syncer's certificate (enables TLS)",
                      flag_values=fv)
  flags.DEFINE_string("tls-cert", None, "PEM client certificate (mutual TLS)", flag_values=fv)
  flags.DEFINE_string("tls-key", None, "PEM private key of --tls-cert", flag_values=fv)
  flags.DEFINE_string("tls-server-name", None, "name expected in the syncer's certificate, if not the "
                      "--syncer host", flag_values=fv)


def targets(fv: flags.FlagValues) -> list[str]:
  """--syncer: one host:port per syncer shard, checked."""
  try:
    return sharded.parse_targets(fv.syncer)
  except ValueError as e:
    raise cli.UsageError(str(e)) from None


def token(fv: flags.FlagValues) -> str:
  try:
    return run_token.read_token(fv["token-file"].value)
  except OSError as e:
    raise cli.UsageError(f"--token-file: cannot read {e.filename!r}: {e.strerror}") from None
  except ValueError as e:
    raise cli.UsageError(str(e)) from None


def tls(fv: flags.FlagValues) -> dict:
  """Keyword arguments of `GrpcTransport` for TLS."""
  return {"tls_ca": fv["tls-ca"].value, "tls_cert": fv["tls-cert"].value, "tls_key": fv["tls-key"].value,
          "tls_server_name": fv["tls-server-name"].value}
