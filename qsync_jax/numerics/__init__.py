"""qsync_jax/numerics."""
