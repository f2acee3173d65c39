"""The run token: the secret every call to the syncer carries, read from a file or $DILOCO_TOKEN (never from a
command line: argv is visible to every user of the machine)."""

from __future__ import annotations

import logging
import os
import pathlib

log = logging.getLogger(__name__)

TOKEN_ENV = "DILOCO_TOKEN"


def read_token(token_file: str | None = None) -> str:
  """The run token from `token_file`, else from $DILOCO_TOKEN. Raises ValueError if there is none.

  Never from a command line: argv is visible to every user of the machine.
  """
  if token_file:
    path = pathlib.Path(token_file)
    mode = path.stat().st_mode
    if mode & 0o077:
      log.warning("token file %s is readable by other users (mode %o); chmod 600 it", path, mode & 0o777)
    token = path.read_text().strip()
    if not token:
      raise ValueError(f"token file {path} is empty")
    return token
  token = os.environ.get(TOKEN_ENV, "").strip()
  if not token:
    raise ValueError(f"no run token: pass --token-file or set ${TOKEN_ENV}")
  return token
