"""Which recipe should I scale? Variants x seeds as ordinary runs, early-half fits checked on the
late half: `python -m scalerl_jax.study` (see `__main__`)."""
