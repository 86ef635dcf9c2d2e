"""Entry points: each module parses its command line, calls the library and maps known errors to
one line and an exit status (`errors`). `scalerl COMMAND` (`__main__`) dispatches to them; each
also runs as `python -m scalerl_jax.cli.MODULE`, and the RL job as `python -m scalerl_jax.main`."""
