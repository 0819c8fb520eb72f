"""Hand-written CUDA kernels, compiled on first use with torch.utils.cpp_extension (nvcc, ninja).

Each kernel file names its plain-PyTorch twin, which is the CPU path and the kernel's test
oracle; a CUDA run without a compiler gets the twin, with one warning saying why.

- `token_logprobs.cu`: the softmax passes of per-token log-probabilities (twins:
  `rlcore.losses.logprobs.chunk_stats` and `chunk_grad_`).
- `decode_attention.cu`: flash-decoding, one new token per row against the rollout's static KV
  cache (twin: `rlcore.rollout.attention.decode_attention_twin`). It has no torch headers and is
  called through ctypes (`decode_attention.py`), so it builds in seconds.

The first CUDA call builds the extension into torch's extension cache (~/.cache/torch_extensions,
or $TORCH_EXTENSIONS_DIR) for the GPU at hand, which takes about a minute; later runs load it.
Set RLCORE_CUDA_KERNELS=0 to run the twins on CUDA too.

While it builds, torch holds a lock file in the build directory, and every other process that
wants the extension waits until it is gone, without a word. A build that is killed
(SIGKILL, the OOM killer, a preempted job) leaves the file behind, so `build` removes a lock
older than `STALE_LOCK_MINUTES`, with a warning, and names the lock it waits on otherwise.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from rlcore import RlcoreWarning

SOURCES = {"token_logprobs": Path(__file__).with_name("token_logprobs.cu"),
           "decode_attention": Path(__file__).with_name("decode_attention.cu")}
PLAIN_C = {"decode_attention"}  # no torch headers: a plain shared library, called through ctypes
_loaded: dict[str, ModuleType | None] = {}
STALE_LOCK_MINUTES = 20  # a build takes about a minute; older than this, its builder is gone


def build(name: str, verbose: bool = False) -> ModuleType:
    """Compile (or load the cached build of) the extension `name` and return it (for a plain-C
    kernel, its ctypes binding). Raises when the build fails; set TORCH_CUDA_ARCH_LIST to build on
    a machine without a GPU."""
    from torch.utils import cpp_extension

    # The directory load() would pick (torch's private helper, there since torch 1.x).
    find_dir = getattr(cpp_extension, "_get_build_directory", None)
    build_dir = find_dir(f"rlcore_{name}", verbose) if find_dir else None
    if build_dir:
        clear_stale_lock(Path(build_dir) / "lock")
    built = cpp_extension.load(name=f"rlcore_{name}", sources=[str(SOURCES[name])], build_directory=build_dir,
                               extra_cuda_cflags=["-O3"], verbose=verbose, is_python_module=name not in PLAIN_C)
    if name in PLAIN_C:  # load() returned the library's path
        from rlcore.cuda.decode_attention import DecodeAttention
        return DecodeAttention(built)
    return built


def clear_stale_lock(lock: Path) -> None:
    """Remove torch's build lock `lock` if a killed build left it (older than STALE_LOCK_MINUTES);
    otherwise say that this process waits on it (another process is building)."""
    try:
        seen = lock.stat()
    except FileNotFoundError:
        return
    age = time.time() - seen.st_mtime
    if age < STALE_LOCK_MINUTES * 60:
        print(f"rlcore: waiting for another process's build of the CUDA kernels (it holds {lock}, "
              f"{age:.0f} s old); if no process is building them, delete that file", file=sys.stderr, flush=True)
        return
    try:
        if lock.stat().st_ino != seen.st_ino:  # another process has just replaced it with its own
            return
        lock.unlink()
    except FileNotFoundError:
        return
    warnings.warn(f"removed {lock}, left {age / 60:.0f} minutes ago by a build of rlcore's CUDA kernels that did not "
                  f"finish (killed, or its machine stopped): torch would have waited on it forever",
                  RlcoreWarning, stacklevel=3)


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
