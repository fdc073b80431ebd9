"""The package version, read by ``pyproject.toml`` and ``qsync_jax.__version__``."""

__version__ = "0.1.0"
