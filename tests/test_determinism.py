"""The gradient jits' compile option (sparrow_jax/determinism.py): a name XLA accepts (a
misspelt option fails the compile), which the training steps' jits carry. Whether it makes a
GPU run's resume bit for bit is the GPU lane's (scripts/test_gpu.sh train: the trainer's resume
tests)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.determinism import DETERMINISTIC_SCATTER


def test_xla_accepts_the_option_and_the_embedding_gradient_is_the_scatter_sum():
    grad = jax.jit(jax.grad(lambda e, i: jnp.sum(e[i] ** 2)),
                   compiler_options=DETERMINISTIC_SCATTER)
    table = jnp.arange(12.0).reshape(4, 3)
    got = np.asarray(grad(table, jnp.array([1, 1, 3])))
    want = np.zeros((4, 3))
    want[1] = 2 * 2 * np.arange(3.0, 6.0)        # row 1 taken twice
    want[3] = 2 * np.arange(9.0, 12.0)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(Exception, match="No such compile option"):
        jax.jit(lambda x: x, compiler_options={"xla_gpu_no_such_option": True})(1.0)


def test_the_gradient_jits_carry_it():
    from sparrow_jax.rl import distill, update

    for module in (update, distill):
        text = Path(module.__file__).read_text()
        assert "compiler_options=DETERMINISTIC_SCATTER" in text, module.__name__
