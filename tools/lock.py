"""Writes `constraints.txt`: the exact version of every package that any extra of pyproject.toml
installs, as pip resolves them now for this platform (`make lock`; `make upgrade` also reinstalls and
runs the numerics tests).

pip resolves all extras together without installing anything (`pip install --dry-run --report`), so
the GPU and TPU plugins are pinned beside what this machine installs. The file is a pip constraints
file: `pip install -c constraints.txt -e '.[EXTRAS]'` installs exactly these versions of whatever
the extras ask for, and nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

PROJECT = "scalerl_jax"
ALL_EXTRAS = ("cuda", "tpu", "wandb", "bench", "lint", "test")
HEADER = """\
# The exact versions CI tests, for every extra of pyproject.toml: made by `make lock` (tools/lock.py)
# with pip's resolver on {platform}, CPython {python}. Installed by `make demo` and `make test`
# (`pip install -c constraints.txt -e '.[test,lint]'`); elsewhere `pip install -c constraints.txt -e
# '.[cuda]'` (or tpu, wandb, bench). `make upgrade` refreshes it to the newest versions pyproject
# allows and runs the numerics tests, so a new jax, flax or transformers arrives as a diff of this
# file with its measured effect. Local version labels (torch's `+cpu`) are left out: pip takes the
# build the machine offers for that version.
"""


def normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares it: lower case, runs of `-_.` as one `-`."""
    out, previous_sep = [], False
    for ch in name.lower():
        is_sep = ch in "-_."
        if is_sep and not previous_sep:
            out.append("-")
        elif not is_sep:
            out.append(ch)
        previous_sep = is_sep
    return "".join(out)


def public_version(version: str) -> str:
    """The version without its local label (PEP 440: `2.13.0+cpu` -> `2.13.0`)."""
    return version.split("+", 1)[0]


def lock_lines(report: Mapping, pip_version: str) -> list[str]:
    """`name==version` for every package pip's install report would install, sorted by normalized
    name, the project itself left out and pip itself added (it installs everything else)."""
    pins = {
        normalized(item["metadata"]["name"]): public_version(item["metadata"]["version"]) for item in report["install"]
    }
    pins.pop(normalized(PROJECT), None)
    pins["pip"] = pip_version
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def read_lock(text: str) -> dict[str, str]:
    """The pins of a constraints file: normalized name -> version; comments and blanks skipped."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[normalized(name)] = version
    return pins


def changes(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    """One line per package added, removed or moved between two locks."""
    lines = []
    for name in sorted(set(old) | set(new)):
        before, after = old.get(name), new.get(name)
        if before != after:
            lines.append(f"  {name}: {before or '(none)'} -> {after or '(none)'}")
    return lines


def resolve(project_dir: str, extras: Sequence[str]) -> dict:
    """pip's install report for the project with these extras, resolved afresh (`--ignore-installed`)."""
    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, "report.json")
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        command += ["--report", report_path, f"{project_dir}[{','.join(extras)}]"]
        subprocess.run(command, check=True)
        with open(report_path) as f:
            return json.load(f)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Writes constraints.txt: the exact versions of every extra.")
    parser.add_argument("--out", default="constraints.txt", help="the constraints file to write")
    args = parser.parse_args(argv)
    project_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    import pip  # the pip that resolves is the pip the lock pins

    lines = lock_lines(resolve(project_dir, ALL_EXTRAS), pip.__version__)
    old = read_lock(open(args.out).read()) if os.path.exists(args.out) else {}
    moved = changes(old, read_lock("\n".join(lines)))
    if moved:  # an unchanged lock keeps its time stamp, so make does not rebuild the environment
        header = HEADER.format(platform=f"{sys.platform} {platform.machine()}", python=platform.python_version())
        with open(args.out, "w") as f:
            f.write(header + "\n".join(lines) + "\n")
    print(f"{args.out}: {len(lines)} packages; {len(moved)} changed" + (":" if moved else ""))
    print("\n".join(moved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
