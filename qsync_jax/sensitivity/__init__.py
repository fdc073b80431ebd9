"""qsync_jax/sensitivity."""
