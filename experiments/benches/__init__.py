"""experiments/benches."""
