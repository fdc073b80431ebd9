"""experiments/studies."""
