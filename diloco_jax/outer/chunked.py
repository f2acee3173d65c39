"""Long vectors in cache-sized chunks, and a kernel run over them on a few threads.

The codecs and the outer step go through fragments (up to hundreds of millions of float32 elements) one
chunk at a time: every temporary is chunk-sized and stays in the core's cache, so a pass costs about the
bytes of the arrays it must read and write, and host memory never grows by a fragment-sized temporary.

`run(kernel, size, step, threads, scratch)` calls `kernel(start, stop, buf)` for consecutive ranges of
`step` elements covering [0, size), where `buf` is a float32 work array of `scratch` elements that the
kernel may overwrite (one per thread, reused from range to range); with `threads` > 1 the ranges are split
into `threads` contiguous runs, each on a thread of a shared pool (numpy releases the GIL inside its array
operations, so the runs proceed in parallel on a host with that many cores). The results come back in
range order, whatever the threads, so a reduction over them (a sum of squares) does not depend on the
thread count.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Callable
from typing import TypeVar

import numpy as np

T = TypeVar("T")

# 64K float32 = 256 KB: a chunk and a few temporaries of its size fit a core's L2 cache.
CHUNK_ELEMS = 1 << 16
# Threads a syncer takes by default (`syncer.merge_threads` = 0): this host's cores, at most this many.
DEFAULT_THREAD_LIMIT = 8


def default_threads(limit: int = DEFAULT_THREAD_LIMIT) -> int:
  """The cores this process may run on, at most `limit`."""
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    cores = os.cpu_count() or 1
  return max(1, min(cores, limit))


@functools.cache
def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
  # One pool per thread count for the life of the process (daemon-like workers; idle ones cost nothing).
  return concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="chunked")


def ranges(size: int, step: int) -> list[tuple[int, int]]:
  """[(start, stop)] of consecutive pieces of at most `step` elements covering [0, size)."""
  if step < 1:
    raise ValueError(f"chunk step must be >= 1, got {step}")
  return [(start, min(start + step, size)) for start in range(0, size, step)]


def run(kernel: Callable[[int, int, np.ndarray], T], size: int, step: int, threads: int = 1,
        scratch: int = 0) -> list[T]:
  """[kernel(start, stop, buf) for each range of `ranges(size, step)`], in range order, on `threads`
  threads; `buf`: a float32[scratch] work array per thread."""
  pieces = ranges(size, step)
  threads = max(1, min(int(threads), len(pieces)))

  def do(run_):
    buf = np.empty(scratch, np.float32)
    return [kernel(a, b, buf) for a, b in run_]

  if threads == 1:
    return do(pieces)
  per = -(-len(pieces) // threads)
  futures = [_pool(threads).submit(do, pieces[i:i + per]) for i in range(0, len(pieces), per)]
  return [out for f in futures for out in f.result()]


def norm(vec: np.ndarray, threads: int = 1) -> float:
  """The L2 norm of a float32 vector: float32 sums of squares per chunk (exact to a relative 2^-8 whatever
  the vector's length), added in float64; inf if a chunk's sum overflows (an absurd vector)."""
  vec = np.asarray(vec, np.float32).reshape(-1)

  def kernel(a, b, buf):
    part = vec[a:b]
    with np.errstate(over="ignore", invalid="ignore"):
      return float(np.dot(part, part))

  return float(np.sqrt(sum(run(kernel, vec.size, CHUNK_ELEMS, threads))))
