"""The ``python -m qsync_jax.distributed`` command: the localhost launcher.

Its flags, usage and body are :mod:`qsync_jax.launch.cli`'s; this module only
runs it as the program.
"""

from qsync_jax.launch import cli

if __name__ == "__main__":
  cli.run()
