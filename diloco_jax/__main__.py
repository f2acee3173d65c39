"""`python -m diloco_jax <command> [flags]`: the commands are in `commands.py`."""

import sys

from diloco_jax import commands

if __name__ == "__main__":
  sys.exit(commands.main())
