"""qsync_jax/train."""
