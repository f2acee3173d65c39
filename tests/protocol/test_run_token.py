"""The run token: from a file or the environment."""


import pytest

from diloco_jax.protocol import run_token


def test_read_token(tmp_path, monkeypatch):
  monkeypatch.delenv(run_token.TOKEN_ENV, raising=False)
  with pytest.raises(ValueError, match="no run token"):
    run_token.read_token(None)
  monkeypatch.setenv(run_token.TOKEN_ENV, " from-env \n")
  assert run_token.read_token(None) == "from-env"
  path = tmp_path / "token"
  path.write_text("from-file\n")
  path.chmod(0o600)
  assert run_token.read_token(str(path)) == "from-file"
  path.write_text("\n")
  with pytest.raises(ValueError, match="empty"):
    run_token.read_token(str(path))
