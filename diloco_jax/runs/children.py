"""The child processes of a local run and their logs: the environment, arguments and ports they get
(`child_env`, `config_args`, `free_port`), the run token they share (`write_token`), and `Child`, one
process with its log file (`runs/local.py`, `runs/launcher.py`)."""

from __future__ import annotations

import os
import pathlib
import re
import secrets
import signal
import socket
import subprocess
import sys

from diloco_jax import cli

_DEVICE_FLAG = cli.DEVICE_COUNT_FLAG


def config_args(argv: list[str]) -> list[str]:
  """The `--config FILE` and `--config.x=y` arguments of `argv`, to hand to every child unchanged."""
  out, i = [], 1
  while i < len(argv):
    a = argv[i]
    if a == "--config" or (a.startswith("--config.") and "=" not in a):
      out.append(a)
      if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
        out.append(argv[i + 1])
        i += 1
    elif a.startswith("--config=") or a.startswith("--config."):
      out.append(a)
    i += 1
  return out


def child_env(num_devices: int) -> dict[str, str]:
  """This environment with exactly `num_devices` fake CPU devices (set before the child imports jax)."""
  env = dict(os.environ)
  xla = re.sub(rf"{_DEVICE_FLAG}=\S+", "", env.get("XLA_FLAGS", "")).strip()
  env["XLA_FLAGS"] = f"{xla} {_DEVICE_FLAG}={num_devices}".strip()
  env.setdefault("JAX_PLATFORMS", "cpu")
  env["PYTHONUNBUFFERED"] = "1"
  env[cli.PARENT_PID_ENV] = str(os.getpid())  # the child asks for SIGTERM when this process dies
  return env


class Child:
  """One child process with its log file."""

  def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: pathlib.Path):
    self.name, self.log_path = name, log_path
    self._log = open(log_path, "ab")
    # No preexec_fn: with one, the fork runs jax's at-fork hook ("os.fork() ... will likely lead to a
    # deadlock"); the child sets its own death signal instead (`cli.die_with_parent`, from PARENT_PID_ENV).
    self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)

  @property
  def pid(self) -> int:
    return self.proc.pid

  def poll(self) -> int | None:
    return self.proc.poll()

  def terminate(self) -> None:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)

  def wait(self, timeout: float) -> int | None:
    """Waits up to `timeout`; SIGKILLs the child if it is still alive then. Returns its exit code."""
    try:
      return self.proc.wait(timeout)
    except subprocess.TimeoutExpired:
      print(f"local: {self.name} (pid {self.pid}) did not stop in {timeout:.0f}s: killing it", file=sys.stderr)
      self.proc.kill()
      return self.proc.wait()

  def tail(self, lines: int = 25) -> str:
    """The last `lines` lines of the child's log (closed or not: a failure is reported after `close`)."""
    if not self._log.closed:
      self._log.flush()
    try:
      text = self.log_path.read_bytes()[-16384:].decode(errors="replace")
    except OSError:
      return ""
    # tqdm redraws with carriage returns: keep the last state of each line.
    return "\n".join(line.split("\r")[-1] for line in text.splitlines()[-lines:])

  def close(self) -> None:
    self._log.close()


class ChildFailed(RuntimeError):

  def __init__(self, child: Child):
    super().__init__(f"{child.name} (pid {child.pid}) exited with status {child.poll()}")
    self.child = child



def free_port() -> int:
  """A TCP port free on loopback now (for a learner's jax.distributed coordinator)."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def free_ports(n: int) -> int:
  """The first of `n` consecutive TCP ports free on loopback now (for the shards of a syncer)."""
  for _ in range(100):
    base = free_port()
    socks = []
    try:
      for port in range(base, base + n):
        sock = socket.socket()
        socks.append(sock)
        sock.bind(("127.0.0.1", port))
      return base
    except OSError:
      continue  # one of them is taken: try another base
    finally:
      for sock in socks:
        sock.close()
  raise RuntimeError(f"found no {n} consecutive free ports on loopback")


def write_token(path: pathlib.Path) -> None:
  """A fresh random run token, readable by this user only (created with mode 600, never widened)."""
  path.unlink(missing_ok=True)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(fd, "w") as f:
    f.write(secrets.token_hex(32) + "\n")
