"""Running untrusted code: the bubblewrap sandbox and the code verifier built on it."""

from scalerl_jax.sandbox.bubblewrap import SandboxUnavailable
from scalerl_jax.sandbox.verifier import CodeVerifier, SandboxLimits, Verdict

__all__ = ["CodeVerifier", "SandboxLimits", "SandboxUnavailable", "Verdict"]
