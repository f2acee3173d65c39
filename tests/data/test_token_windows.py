"""Token windows over shard files (`data/token_windows.py`)."""


import numpy as np
import pytest

import helpers
from diloco_jax.data import token_windows

data_cfg, file_streams = helpers.data_cfg, helpers.file_streams


def test_token_windows_read_each_file_stream_in_order(token_data):
  cfg = data_cfg(token_data, seq_len=64)
  paths = token_windows.resolve_files(cfg.train_files, "data.train_files")
  source = token_windows.TokenWindows(paths, 64, helpers.TOKEN_VOCAB)
  streams = file_streams(paths)
  assert source.file_tokens == tuple(s.size for s in streams)
  assert len(source) == sum((s.size - 1) // 64 for s in streams)
  i = 0
  for stream in streams:
    for j in range((stream.size - 1) // 64):
      w = source[i]["tokens"]
      assert w.dtype == np.int32 and w.shape == (65,)
      np.testing.assert_array_equal(w, stream[j * 64:j * 64 + 65])
      i += 1
  with pytest.raises(IndexError):
    source[len(source)]
