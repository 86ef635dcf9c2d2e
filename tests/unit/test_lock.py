"""The lock (`constraints.txt`, written by tools/lock.py): what it pins from pip's report, that this
environment holds exactly those versions, and that the README names the versions it pins."""

import importlib.metadata
import importlib.util
import re

import pytest
from repo_paths import REPO

LOCK_PATH = f"{REPO}/constraints.txt"
# The versions a researcher checks first; the README's "Tested versions" must list these.
README_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "transformers", "torch")


@pytest.fixture(scope="module")
def lock_module():
    spec = importlib.util.spec_from_file_location("lock", f"{REPO}/tools/lock.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pins(lock_module) -> dict[str, str]:
    with open(LOCK_PATH) as f:
        return lock_module.read_lock(f.read())


def test_lock_lines_pin_what_pip_would_install_without_local_labels_or_the_project(lock_module):
    report = {
        "install": [
            {"metadata": {"name": "Jinja2", "version": "3.1.6"}},
            {"metadata": {"name": "torch", "version": "2.13.0+cpu"}},
            {"metadata": {"name": "scalerl_jax", "version": "0.1.0"}},
            {"metadata": {"name": "typing_extensions", "version": "4.16.0"}},
        ]
    }
    assert lock_module.lock_lines(report, "26.3") == [
        "jinja2==3.1.6",
        "pip==26.3",
        "torch==2.13.0",
        "typing-extensions==4.16.0",
    ]


def test_changes_name_every_package_added_removed_or_moved(lock_module):
    old = {"jax": "0.10.2", "six": "1.17.0", "numpy": "2.4.6"}
    new = {"jax": "0.11.0", "numpy": "2.4.6", "zipp": "4.1.2"}
    assert lock_module.changes(old, new) == [
        "  jax: 0.10.2 -> 0.11.0",
        "  six: 1.17.0 -> (none)",
        "  zipp: (none) -> 4.1.2",
    ]


def test_this_environment_holds_the_locked_version_of_every_package_it_has(lock_module, pins):
    """An environment installed without the lock (or from an older one) fails here, naming each
    package whose version differs."""
    installed = {
        lock_module.normalized(dist.metadata["Name"]): lock_module.public_version(dist.version)
        for dist in importlib.metadata.distributions()
    }
    differ = {
        name: (installed[name], version) for name, version in pins.items() if installed.get(name, version) != version
    }
    assert not differ, f"installed vs constraints.txt: {differ}; reinstall with `make test` (it follows the lock)"
    assert {"jax", "flax", "optax", "transformers", "torch", "pytest", "ruff"} <= set(installed) & set(pins)


def test_readme_names_the_locked_versions(lock_module, pins):
    with open(f"{REPO}/README.md") as f:
        line = re.search(r"Tested versions: (.*?)\.\s+[A-Z]", " ".join(f.read().split()))
    assert line, "README.md has no 'Tested versions: ...' sentence"
    named = dict(re.findall(r"([A-Za-z][\w.-]*) (\d[\w.]*)", line.group(1)))
    assert set(README_PACKAGES) <= set(named), named
    assert {name: named[name] for name in README_PACKAGES} == {name: pins[name] for name in README_PACKAGES}
