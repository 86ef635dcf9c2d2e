"""A training run: builders (`build`), evaluation, reporting, the three process kinds and the
composition root (`root.run`) that wires them."""

from scalerl_jax.run.root import RUN_ERRORS, run

__all__ = ["RUN_ERRORS", "run"]
