"""The one exception a config check raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """Config values that cannot run; `problems` holds one line per problem, each naming its key."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} config problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)
