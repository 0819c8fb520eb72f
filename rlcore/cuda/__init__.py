"""Hand-written CUDA kernels, compiled on first use with torch.utils.cpp_extension (nvcc, ninja).

Each kernel file names its plain-PyTorch twin, which is the CPU path and the kernel's test
oracle; a CUDA run without a compiler gets the twin, with one warning saying why.

- `token_logprobs.cu`: the softmax passes of per-token log-probabilities (twins:
  `rlcore.losses.logprobs.chunk_stats` and `chunk_grad_`).

The first CUDA call builds the extension into torch's extension cache (~/.cache/torch_extensions,
or $TORCH_EXTENSIONS_DIR) for the GPU at hand, which takes about a minute; later runs load it.
Set RLCORE_CUDA_KERNELS=0 to run the twins on CUDA too.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

from rlcore import RlcoreWarning

SOURCES = {"token_logprobs": Path(__file__).with_name("token_logprobs.cu")}
_loaded: dict[str, ModuleType | None] = {}


def build(name: str, verbose: bool = False) -> ModuleType:
    """Compile (or load the cached build of) the extension `name` and return it. Raises when the
    build fails; set TORCH_CUDA_ARCH_LIST to build on a machine without a GPU."""
    from torch.utils import cpp_extension

    return cpp_extension.load(name=f"rlcore_{name}", sources=[str(SOURCES[name])],
                              extra_cuda_cflags=["-O3"], verbose=verbose)


def kernels(name: str, device: torch.device) -> ModuleType | None:
    """The extension `name` for tensors on `device`, or None where the twin runs: on CPU, with
    RLCORE_CUDA_KERNELS=0, or when the build failed (warned once per process)."""
    if device.type != "cuda" or os.environ.get("RLCORE_CUDA_KERNELS", "1") == "0":
        return None
    if name not in _loaded:
        print(f"rlcore: loading the CUDA kernels in {SOURCES[name].name} (built on first use, about a minute)",
              file=sys.stderr, flush=True)
        try:
            _loaded[name] = build(name)
        except Exception as e:  # no nvcc, a toolkit torch does not match, a compiler error
            _loaded[name] = None
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            warnings.warn(f"rlcore's CUDA kernels in {SOURCES[name].name} could not be built ({first}); their "
                          f"PyTorch twins run instead, with the same results, slower. To build them, install "
                          f"CUDA's nvcc for CUDA {torch.version.cuda} (torch's) and ninja, and set CUDA_HOME; "
                          f"RLCORE_CUDA_KERNELS=0 skips the attempt.", RlcoreWarning, stacklevel=2)
    return _loaded[name]
