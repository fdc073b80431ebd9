"""qsync_jax/allocation."""
