"""Tests of qsync_jax.numerics.flatten."""

import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np

from qsync_jax.numerics import flatten


def test_ravel_matches_ravel_pytree_element_for_element():
  tree = {
    "b": jnp.arange(3, dtype=jnp.float32),
    "a": [jnp.ones((2, 3)) * 2.0, jnp.float32(7.0)],
    "c": {"z": jnp.arange(4, dtype=jnp.int32).reshape(2, 2)},
  }
  got = flatten.ravel(tree)
  want = ravel_pytree(tree)[0]
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_ravel_of_an_empty_tree_is_an_empty_vector():
  assert flatten.ravel({}).shape == (0,)


def test_a_raveled_gradient_keeps_its_weight_gradient_out_of_a_concatenate():
  # The reason the module exists: no concatenate for XLA to fuse the
  # weight-gradient dot into.
  params = {"w": jnp.ones((64, 32)), "b": jnp.zeros((32,))}
  x = jnp.ones((4, 64))

  def loss(p):
    return jnp.sum(jax.nn.relu(x @ p["w"] + p["b"]) ** 2)

  def flat_grad(p):
    return flatten.ravel(jax.grad(loss)(p))

  hlo = jax.jit(flat_grad).lower(params).as_text()
  assert "concatenate" not in hlo
  np.testing.assert_allclose(
    np.asarray(jax.jit(flat_grad)(params)),
    np.asarray(ravel_pytree(jax.grad(loss)(params))[0]),
    rtol=1e-6,
  )
