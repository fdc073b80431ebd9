"""qsync_jax/plan."""
