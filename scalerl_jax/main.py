"""`python -m scalerl_jax.main --config=configs/tiny.py --workdir=DIR`: the RL job's documented
command, kept as the user's entry point; the job itself is `scalerl_jax.cli.train`."""

from scalerl_jax.cli.train import cli

if __name__ == "__main__":
    cli()
