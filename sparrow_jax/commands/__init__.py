"""Implementations of the ``sparrow`` subcommands, one module each (see sparrow_jax.cli)."""
