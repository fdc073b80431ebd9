"""qsync_jax/parallel."""
