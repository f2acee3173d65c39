"""Command-line plumbing shared by every command: `--config FILE` with `--config.<field>=<value>`
overrides (ml_collections config_flags), validated before anything compiles."""

from __future__ import annotations

import ast
import ctypes
import logging
import os
import pathlib
import re
import signal
import sys
import threading
import time
from collections.abc import Callable

from absl import flags
from ml_collections import config_flags

from diloco_jax import config as config_lib


class UsageError(SystemExit):
  """A bad flag or config field: printed without a traceback, exit status 2."""

  def __init__(self, message: str):
    print(f"error: {message}", file=sys.stderr)
    super().__init__(2)


HELP_FLAGS = ("-h", "--help", "--helpfull")
CACHE_ENV = "DILOCO_JAX_CACHE"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def enable_compilation_cache() -> None:
  """Reuse compiled XLA programs across runs (the same shapes recompile in seconds otherwise, minutes on
  big models). Directory: $DILOCO_JAX_CACHE, default ~/.cache/diloco_jax/xla; set it empty to disable."""
  # Lazy, as every jax import here: commands without a model (sim, plot, status, sizes) use
  # this module and start without importing jax.
  import jax  # noqa: PLC0415 - lazy: see the comment above

  path = os.environ.get(CACHE_ENV, str(pathlib.Path.home() / ".cache" / "diloco_jax" / "xla"))
  if path:
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def devices(count: int, command: str) -> list:
  """`jax.devices()`, with `count` fake CPU devices when the CPU is the only backend.

  Call before anything starts jax's backend. Unless the user chose a CPU device count (XLA_FLAGS with
  --xla_force_host_platform_device_count, or $JAX_NUM_CPU_DEVICES), this sets `jax_num_cpu_devices` to
  `count` and, if the CPU turns out to be the only platform, says so in one line on stderr. On a machine
  with accelerators the setting only shapes the host's CPU backend, which no training step uses.
  """
  import jax  # noqa: PLC0415 - lazy: see enable_compilation_cache

  chosen = DEVICE_COUNT_FLAG in os.environ.get("XLA_FLAGS", "") or os.environ.get("JAX_NUM_CPU_DEVICES")
  asked = False
  if not chosen:
    try:
      jax.config.update("jax_num_cpu_devices", int(count))
      asked = True
    except RuntimeError:  # the backend already started (an embedding program chose its devices)
      pass
  available = jax.devices()
  if asked and available[0].platform == "cpu":
    print(f"{command}: no accelerator: running on {len(available)} fake CPU devices (jax_num_cpu_devices); "
          f"XLA_FLAGS={DEVICE_COUNT_FLAG}=N chooses another count", file=sys.stderr, flush=True)
  return available


def parse(argv: list[str], define_extra: Callable[[flags.FlagValues], None] | None = None,
          doc: str = "", *, config: bool = True) -> flags.FlagValues:
  """`parse_with_args` without the positional arguments."""
  return parse_with_args(argv, define_extra, doc, config=config)[0]


def parse_with_args(argv: list[str], define_extra: Callable[[flags.FlagValues], None] | None = None,
                    doc: str = "", *, config: bool = True) -> tuple[flags.FlagValues, list[str]]:
  """Parse `argv` (argv[0] is the program name) into a fresh FlagValues, with a required `--config` (and
  the XLA compilation cache on) unless `config=False` (commands that train nothing). Returns the flags and
  the positional arguments.

  An unknown config field, a value of the wrong type, a missing --config or a config file that does not
  exist exits with status 2 and a message naming the field or file. `-h`/`--help` prints `doc` and the
  flags, and exits 0, before anything imports jax. With `config=False` a command without a model (the
  simulator) gets only its own flags, and jax is not imported.
  """
  fv = _flag_values(argv, define_extra, config)
  if any(a in HELP_FLAGS for a in argv[1:]):
    print(help_text(argv[0], doc, fv))
    raise SystemExit(0)
  if config:
    _check_config_file(argv)
    enable_compilation_cache()
  try:
    args = fv(argv)[1:]
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    detail = flag_error_text(e)
    overrides = [a.split("=")[0] for a in argv if a.startswith("--config.")]
    if any(part in detail for o in overrides for part in o.split(".")[1:]):
      raise UsageError(f"bad config override among {overrides}: {detail}") from None
    raise UsageError(f"{detail} (see {argv[0]} --help)") from None
  if config and fv.config is None:
    raise UsageError(_CONFIG_REQUIRED)
  absolute_paths(fv)
  return fv, args


def _flag_values(argv: list[str], define_extra: Callable[[flags.FlagValues], None] | None,
                 config: bool) -> flags.FlagValues:
  fv = flags.FlagValues()
  if config:
    config_flags.DEFINE_config_file("config", None, "ml_collections config file (configs/*.py), required; "
                                    "--config.<field>=<value> overrides a field.",
                                    flag_values=fv, lock_config=True, sys_argv=argv)
    fv["config"].default_as_str = None  # required: the help shows no "(default: 'None')"
  if define_extra:
    define_extra(fv)
  return fv


def help_text(program: str, doc: str, fv: flags.FlagValues) -> str:
  """A command's `--help`: its usage line, `doc` and its flags."""
  return (f"usage: {program} [flags]\n\n{doc.strip()}\n\nflags:\n{fv.get_help()}" if doc
          else f"usage: {program} [flags]\n\nflags:\n{fv.get_help()}")


def command_help(program: str, doc: str, define_extra: Callable[[flags.FlagValues], None],
                 config: bool = True) -> str:
  """The `--help` that `parse(argv, define_extra, doc, config=config)` prints, built without parsing."""
  return help_text(program, doc, _flag_values([program], define_extra, config))


# Every flag and config field that names a local file or directory (the ones listing several: comma-separated).
PATH_FLAGS = ("workdir", "model", "checkpoint-dir", "data", "tokenizer", "out", "token-file", "tape", "record-tape",
              "schedule", "reference", "root", "tls-cert", "tls-key", "tls-client-ca", "tls-ca")
PATH_LIST_FLAGS = ("syncer-workdir",)
PATH_FIELDS = ("data.path", "data.tokenizer", "emulation.cutoff_file")
PATH_LIST_FIELDS = ("data.train_files", "data.eval_files")


def absolute_path(text: str, many: bool = False) -> str:
  """`text` with a local path made absolute against the working directory (`~` expanded); "" and URLs
  (gs://...) unchanged. `many`: comma-separated paths, each made absolute."""
  if many:
    return ",".join(absolute_path(part.strip()) for part in text.split(","))
  return text if not text or "://" in text else os.path.abspath(os.path.expanduser(text))


def absolute_paths(fv: flags.FlagValues) -> None:
  """Make every path a command takes absolute, in place: the flags of PATH_FLAGS and the config's fields of
  PATH_FIELDS (a relative path then means the same in every library and child process, wherever they
  resolve it: orbax, for one, refuses a relative checkpoint path)."""
  for name in (*PATH_FLAGS, *PATH_LIST_FLAGS):
    if name in fv and fv[name].value:
      value = fv[name].value
      many = name in PATH_LIST_FLAGS
      fv[name].value = ([absolute_path(v, many) for v in value] if isinstance(value, list)
                        else absolute_path(value, many))
  config = fv["config"].value if "config" in fv else None
  for path in (*PATH_FIELDS, *PATH_LIST_FIELDS) if config is not None else ():
    section, name = path.split(".")
    if section in config and name in config[section] and isinstance(config[section][name], str):
      config[section][name] = absolute_path(config[section][name], path in PATH_LIST_FIELDS)


_CONFIG_REQUIRED = "--config is required, e.g. --config configs/small_cpu.py"


def _check_config_file(argv: list[str]) -> None:
  """A `--config FILE[:ARG]` that names no file is a usage error (ml_collections would defer it to a
  chain of tracebacks at the first use of the config)."""
  for i, a in enumerate(argv[1:], 1):
    if a == "--config" and i + 1 < len(argv):
      value = argv[i + 1]
    elif a.startswith("--config="):
      value = a[len("--config="):]
    else:
      continue
    path = value.split(":", 1)[0]
    if not os.path.isfile(path):
      raise UsageError(f"--config: no config file {path!r} (relative to {os.getcwd()}); "
                       "e.g. --config configs/small_cpu.py")


def flag_error_text(e: Exception) -> str:
  """One line of a flag parsing error: ml_collections' field errors come as the repr of a quoted name
  and a suggestion (`'stepz'\\nDid you mean "steps" ...`), read back as "no field 'stepz'; did you mean ..."."""
  text = str(e)
  if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
    try:
      text = str(ast.literal_eval(text))
    except (ValueError, SyntaxError):
      pass
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  if lines and re.fullmatch(r"'[^']*'", lines[0]):
    rest = "; ".join(lines[1:])
    lines = [f"no field {lines[0]}" + (f"; {rest[:1].lower()}{rest[1:]}" if rest else "")]
  return " ".join(" ".join(lines).split())


def validated(config, num_devices: int | None, *, learners: bool, data: bool = True):
  """The one check a command runs on its config, before anything compiles; returns the config resolved
  (`config_lib.resolve`: the RunSpec the command hands to what it builds). Stage 1, the fields
  (`config_lib.validate`); stage 2, with `learners` the run's fragment plan from the model's abstract shapes
  (`check_fragment_plan`), and with `data` (every command that reads the data, i.e. all but the syncer) the
  data files the config names (`data.check_files`). A bad field exits with status 2 and a message naming it."""
  # Lazy: the data pipeline imports jax (through grain), and model-free commands (sim) start without it.
  from diloco_jax.data import pipeline as data_lib  # noqa: PLC0415 - lazy: see the comment above

  try:
    config_lib.validate(config, num_devices, learners=learners)
    if learners:
      check_fragment_plan(config)
    if data:
      data_lib.check_files(config)
  except config_lib.ConfigError as e:
    raise UsageError(str(e)) from None
  return config_lib.resolve(config)


def shown(path: str | os.PathLike) -> str:
  """`path` as a user reads it: relative to the working directory when it is under it (as the command line
  gave it, before `absolute_paths`), else as it is."""
  text = str(path)
  if "://" in text or not os.path.isabs(text):
    return text
  relative = os.path.relpath(text)
  return text if relative.startswith("..") else relative


def prefixed(name: str, error: Exception | str) -> str:
  """`name: error`, without doubling a prefix the error's text already has (`status: status: ...`)."""
  text = str(error)
  return text if text.startswith(f"{name}:") else f"{name}: {text}"


def check_workdir(config, workdir: str | os.PathLike, run_id: str = "") -> None:
  """Exit with status 2 and one line (`config_lib.check_workdir`) when `workdir` holds a run of another
  config or run id; call it before the command writes anything there."""
  try:
    config_lib.check_workdir(config, workdir, run_id)
  except config_lib.ConfigError as e:
    raise UsageError(str(e)) from None


def check_fragment_plan(config) -> None:
  """The run's fragment plan from the model's abstract shapes (nothing compiled or allocated): a plan
  that cannot be made raises ConfigError naming outer.num_fragments (or the field the plan names)."""
  # Lazy, as in `validated`: compute/plans reaches jax through the model.
  from diloco_jax.compute import plans  # noqa: PLC0415 - lazy: see the comment above

  try:
    plans.run_plan(config)
  except ValueError as e:
    message = str(e)
    field = next((f for f in ("outer.sync_every", "outer.fragment_plan", "outer.sync_schedule",
                              "outer.schedule_power") if message.startswith(f)),
                 "outer.num_fragments")
    raise config_lib.ConfigError(f"config.{field}: {message}") from None


EXIT_FAILED = 1
SIGNAL_POLL_S = 0.25  # the longest a stop signal waits for the main thread (`StopSignals.wait`)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: int, *, info_loggers: tuple[logging.Logger, ...] = ()) -> None:
  """A process command's logging: `level` on the root logger with one line format, `info_loggers` at INFO
  whatever the level, absl's (orbax's per-save lines) at WARNING. Forced: importing orbax configured the
  root logger first, so a plain basicConfig did nothing (lines came out as `INFO:name:message`)."""
  logging.basicConfig(level=level, format=LOG_FORMAT, force=True)
  logging.getLogger("absl").setLevel(logging.WARNING)
  for logger in info_loggers:
    logger.setLevel(logging.INFO)


PARENT_PID_ENV = "DILOCO_JAX_PARENT_PID"  # set by `local` for its children (runs/children.py)


def die_with_parent() -> None:
  """In a child of `local` ($DILOCO_JAX_PARENT_PID names the launcher): SIGTERM when the launcher dies
  (Linux's PR_SET_PDEATHSIG), so no child outlives it; if it is already gone, SIGTERM now. The variable is
  removed, so that this process's own children do not inherit it. Elsewhere: nothing."""
  parent = os.environ.pop(PARENT_PID_ENV, "")
  if not parent.isdigit() or sys.platform != "linux":
    return
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    return
  if os.getppid() != int(parent):  # the launcher died before the death signal was set
    os.kill(os.getpid(), signal.SIGTERM)


class StopSignals:
  """SIGTERM and SIGINT ask the process to stop: the first sets `stopped` (polled between steps, or waited
  on with `wait`), says `doing` on stderr and runs `on_first`; with `exit_on_second`, a second one says
  `exiting` and exits at once with `EXIT_FAILED` (for a process whose orderly stop can hang on a dead peer).
  `doing` or `exiting` None: nothing said. `received` lists the signals so far. The previous handlers come
  back when the `with` block ends. Every process command handles its signals with this one class."""

  def __init__(self, name: str, doing: str | None = "stopping", on_first: Callable[[], None] = lambda: None,
               exit_on_second: bool = True, exiting: str | None = "exiting at once"):
    self.name, self.doing, self._on_first, self._exit_on_second = name, doing, on_first, exit_on_second
    self.exiting = exiting
    self.received: list[int] = []
    self.stopped = threading.Event()
    self._previous: dict = {}

  def __enter__(self) -> StopSignals:
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame) -> None:
    del frame
    self.received.append(signum)
    if len(self.received) > 1 and self._exit_on_second:
      if self.exiting is not None:
        print(f"{self.name}: second signal {signum}: {self.exiting}", file=sys.stderr, flush=True)
      os._exit(EXIT_FAILED)
    if len(self.received) == 1:
      if self.doing is not None:
        print(f"{self.name}: signal {signum}: {self.doing}", file=sys.stderr, flush=True)
      self._on_first()
    self.stopped.set()

  def __call__(self) -> bool:
    return self.stopped.is_set()

  def wait(self, timeout_s: float | None = None) -> bool:
    """Wait until a signal came (or `timeout_s` passed); whether one came.

    In slices: Python runs a signal's handler only on the main thread, between bytecodes. When the kernel
    delivers the signal to another thread (any thread may take a process-directed signal, e.g. when the
    main thread has another one pending), the main thread's untimed wait is never interrupted and the
    handler never runs: a syncer once sat through SIGTERM for minutes so."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not self.stopped.is_set():
      left = SIGNAL_POLL_S if deadline is None else min(SIGNAL_POLL_S, deadline - time.monotonic())
      if left <= 0:
        break
      self.stopped.wait(left)
    return self.stopped.is_set()

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
