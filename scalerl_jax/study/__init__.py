"""Which recipe should I scale? Variants x seeds as ordinary runs, early-half fits checked on the
late half. The command line is `scalerl_jax.cli.study` (`scalerl study`)."""
