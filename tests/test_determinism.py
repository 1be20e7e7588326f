"""XLA's deterministic scatter flag for GPU training (sparrow_jax/determinism.py): added to
XLA_FLAGS unless named there already, and the note a GPU run without it prints."""

from sparrow_jax.determinism import SCATTER_FLAG, enable_deterministic_scatter, scatter_warning


def test_the_flag_is_added_once_and_a_users_choice_stands():
    env = {}
    assert enable_deterministic_scatter(env)
    assert env["XLA_FLAGS"] == f"{SCATTER_FLAG}=true"
    assert not enable_deterministic_scatter(env)            # already there: unchanged
    assert env["XLA_FLAGS"] == f"{SCATTER_FLAG}=true"
    env = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}
    assert enable_deterministic_scatter(env)
    assert env["XLA_FLAGS"] == f"--xla_gpu_enable_command_buffer= {SCATTER_FLAG}=true"
    for own in (f"{SCATTER_FLAG}=false", SCATTER_FLAG):     # the user's own setting
        env = {"XLA_FLAGS": f"--a=1 {own}"}
        assert not enable_deterministic_scatter(env) and env["XLA_FLAGS"] == f"--a=1 {own}"
    # A longer flag that starts with the same letters is not this one.
    env = {"XLA_FLAGS": f"{SCATTER_FLAG}_other=1"}
    assert enable_deterministic_scatter(env)
    assert env["XLA_FLAGS"].split() == [f"{SCATTER_FLAG}_other=1", f"{SCATTER_FLAG}=true"]


def test_only_a_gpu_run_without_the_flag_is_warned():
    assert SCATTER_FLAG in scatter_warning("gpu", {})
    assert scatter_warning("gpu", {"XLA_FLAGS": f"{SCATTER_FLAG}=true"}) is None
    assert scatter_warning("gpu", {"XLA_FLAGS": f"{SCATTER_FLAG}=false"}) is None  # chosen
    assert scatter_warning("cpu", {}) is None and scatter_warning("tpu", {}) is None
