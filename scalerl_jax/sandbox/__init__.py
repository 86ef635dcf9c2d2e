"""Running untrusted code: the bubblewrap sandbox and the code verifier built on it."""
