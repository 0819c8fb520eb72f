"""rlcore/cuda's kernels against their PyTorch twins and the fp64 definition.

- On any machine whose torch is a CUDA build and which has nvcc (CI's): the extension compiles.
- Anywhere: the loader falls back to the twin, with one warning, when the build fails, and
  RLCORE_CUDA_KERNELS=0 keeps the twins on CUDA.
- On a GPU (skipped without one): each kernel equals its twin on the same inputs (fp64 to 1e-12,
  fp32 to 1e-5 relative to the logits' scale), over vocabularies that do and do not fill a block,
  logits of standard deviation up to 60, temperatures and every option; `token_logprobs` through the kernels equals the
  fp64 definition, gradients included. The decode-attention kernel equals its twin and the fp64
  definition over batch sizes, cache lengths, per-row ranges, head dims and grouped-query layouts,
  in fp32 and bf16. `bash bench/gpu.sh` runs these with tests/test_gpu.py.
"""

import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from rlcore import RlcoreWarning, cuda
from rlcore.losses.logprobs import chunk_grad_, chunk_stats, token_logprobs
from rlcore.rollout.attention import decode_attention_twin
from test_logprobs import naive_fp64

ROOT = Path(__file__).resolve().parents[1]
CUDA_HOME = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def default_setting(monkeypatch):
    monkeypatch.delenv("RLCORE_CUDA_KERNELS", raising=False)
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.fixture
def fresh_loader(monkeypatch):
    """The test loads (or fails to load) the kernels itself."""
    monkeypatch.setattr(cuda, "_loaded", {})


# ----------------------------------------------------------------------------- building and loading

def nvcc_release() -> str | None:
    """The CUDA release of the nvcc under CUDA_HOME ('13.0'), or None without one."""
    nvcc = Path(CUDA_HOME) / "bin" / "nvcc"
    if not nvcc.exists():
        return None
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else None


@pytest.mark.skipif(torch.version.cuda is None, reason="torch is a CPU build: it cannot build CUDA extensions")
@pytest.mark.skipif(nvcc_release() is None, reason=f"no nvcc under {CUDA_HOME}")
@pytest.mark.skipif((nvcc_release() or "").split(".")[0] != (torch.version.cuda or "").split(".")[0],
                    reason="nvcc's CUDA major version is not torch's: torch refuses to build with it")
@pytest.mark.skipif(shutil.which("ninja") is None, reason="torch.utils.cpp_extension needs ninja")
@pytest.mark.parametrize("name,summary,built", [
    ("token_logprobs", "sorted(n for n in dir(m) if not n.startswith('_'))", "['logit_grad_', 'softmax_stats']"),
    ("decode_attention", "(type(m).__name__, m.group)", "('DecodeAttention', 8)"),  # loaded through ctypes
])
def test_the_kernels_compile(tmp_path, name, summary, built):
    """The build a CUDA run does on first use, here for Hopper (sm_90), in a fresh cache."""
    env = dict(os.environ, CUDA_HOME=CUDA_HOME, TORCH_EXTENSIONS_DIR=str(tmp_path),
               TORCH_CUDA_ARCH_LIST=os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"))
    code = f"from rlcore import cuda; m = cuda.build({name!r}); print({summary})"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().splitlines()[-1] == built


@pytest.mark.usefixtures("fresh_loader")
def test_a_failed_build_warns_once_and_the_twin_runs(monkeypatch):
    calls = []

    def no_compiler(name, verbose=False):
        calls.append(name)
        raise RuntimeError("Error building extension 'rlcore_token_logprobs': nvcc not found")

    monkeypatch.setattr(cuda, "build", no_compiler)
    with pytest.warns(RlcoreWarning, match=r"could not be built \(Error building .*nvcc not found\).*twins run"):
        assert cuda.kernels("token_logprobs", torch.device("cuda")) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cuda.kernels("token_logprobs", torch.device("cuda")) is None
    assert calls == ["token_logprobs"]


@pytest.fixture
def no_compiling(monkeypatch, tmp_path):
    """cpp_extension.load records where it would build instead of building; the cache is tmp_path."""
    from torch.utils import cpp_extension

    loads = []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: loads.append(kw) or "module")
    return loads


def build_lock(cache: Path) -> Path:
    """The lock file torch's load() holds while it builds rlcore's kernels in `cache`."""
    lock = cache / "rlcore_token_logprobs" / "lock"
    lock.parent.mkdir()
    lock.touch()
    return lock


def test_a_lock_left_by_a_killed_build_is_removed(no_compiling, tmp_path):
    """torch waits forever, silently, on a build lock that a killed build left behind."""
    lock = build_lock(tmp_path)
    old = lock.stat().st_mtime - (cuda.STALE_LOCK_MINUTES + 1) * 60
    os.utime(lock, (old, old))
    removed = rf"removed {re.escape(str(lock))}, left 21 minutes ago by a build .* did not finish"
    with pytest.warns(RlcoreWarning, match=removed):
        assert cuda.build("token_logprobs") == "module"
    assert not lock.exists()
    assert no_compiling[0]["build_directory"] == str(lock.parent)


def test_a_build_in_progress_is_waited_on_by_name(no_compiling, tmp_path, capsys):
    lock = build_lock(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cuda.build("token_logprobs") == "module"
    assert lock.exists()  # another process is building: torch's load() waits for it
    assert f"waiting for another process's build of the CUDA kernels (it holds {lock}" in capsys.readouterr().err


def test_a_build_without_a_lock_says_nothing(no_compiling, tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cuda.build("token_logprobs") == "module"
    assert capsys.readouterr().err == ""
    assert no_compiling[0]["name"] == "rlcore_token_logprobs"


@pytest.mark.usefixtures("fresh_loader")
def test_no_kernels_on_cpu_or_when_switched_off(monkeypatch):
    monkeypatch.setattr(cuda, "build", lambda *a, **k: pytest.fail("nothing should be built"))
    assert cuda.kernels("token_logprobs", torch.device("cpu")) is None
    monkeypatch.setenv("RLCORE_CUDA_KERNELS", "0")
    assert cuda.kernels("token_logprobs", torch.device("cuda")) is None


class TwinsAsKernels:
    """The extension's contract, kept by the twins: softmax_stats returns new [C] tensors (and
    with write_probs leaves the softmax in z), logit_grad_ overwrites z. Records its calls."""

    def __init__(self):
        self.calls = []

    def softmax_stats(self, z, targets, write_probs):
        self.calls.append("softmax_stats")
        assert z.is_contiguous() and targets.is_contiguous(), "the kernel refuses strided inputs"
        return list(chunk_stats(z, targets, torch.empty_like(z), write_probs))

    def logit_grad_(self, z, targets, lse, entropy, g, g_h):
        self.calls.append("logit_grad_")
        vectors = (targets, lse, entropy, g) + (() if g_h is None else (g_h,))
        assert z.is_contiguous() and all(v.is_contiguous() for v in vectors), "the kernel refuses strided inputs"
        return chunk_grad_(z, targets, lse, entropy, g, g_h, None if g_h is None else torch.empty_like(z))


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("entropy_term", [False, True])
def test_token_logprobs_calls_the_kernels_as_their_contract_says(monkeypatch, recompute, entropy_term):
    """On CPU, with the twins standing in for the extension: token_logprobs hands the kernels the
    right chunks and reads their results back (values and gradients equal the fp64 definition),
    and uses logit_grad_ exactly when backward recomputes the logits."""
    fake = TwinsAsKernels()
    monkeypatch.setattr(cuda, "kernels", lambda name, device: fake)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=g, dtype=torch.float64).requires_grad_()
    weight = (torch.randn(50, 16, generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    targets = torch.randint(50, (3, 7), generator=g)
    up = torch.randn(3, 7, generator=g, dtype=torch.float64)
    logp, ent = token_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=4, recompute=recompute)
    loss = (logp * up).sum() + (ent.sum() if entropy_term else 0)
    got = (logp, ent) + torch.autograd.grad(loss, (hidden, weight))
    ref_logp, ref_ent = naive_fp64(hidden, weight, targets, temperature=0.7)
    ref_loss = (ref_logp * up).sum() + (ref_ent.sum() if entropy_term else 0)
    ref = (ref_logp, ref_ent) + torch.autograd.grad(ref_loss, (hidden, weight))
    for name, a, r in zip(("logp", "entropy", "d hidden", "d weight"), got, ref):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    chunks = 6  # 21 rows in chunks of 4
    assert fake.calls == ["softmax_stats"] * chunks + (["logit_grad_"] * chunks if recompute else [])


def test_strided_targets_reach_the_kernels_contiguous(monkeypatch):
    """One completion token per row, sliced from wider ids (`ids[:, -1:]`): flattening that slice
    is a strided view, which the kernels refuse; token_logprobs hands them a contiguous copy."""
    monkeypatch.setattr(cuda, "kernels", lambda name, device: TwinsAsKernels())
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 1, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64) * 0.5
    targets = torch.randint(50, (3, 9), generator=g)[:, -1:]
    assert not targets.reshape(-1).is_contiguous()
    logp, ent = token_logprobs(hidden, weight, targets)
    ref_logp, ref_ent = naive_fp64(hidden, weight, targets)
    torch.testing.assert_close((logp, ent), (ref_logp, ref_ent), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- the kernels on a GPU

def kernel():
    ext = cuda.kernels("token_logprobs", torch.device("cuda"))
    assert ext is not None, "the CUDA kernels did not build (see the warning)"
    return ext


def random_logits(rows, vocab, scale, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale).to(dtype)
    targets = torch.randint(vocab, (rows,), generator=g)
    return z, targets


def tolerance(dtype, scale):
    """Absolute, in proportion to the logits' scale: fp64 to 1e-12, fp32 to 1e-5."""
    return dict(rtol=0, atol=(1e-12 if dtype == torch.float64 else 1e-5) * max(scale, 1))


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 7), (5, 511), (5, 513), (64, 32000), (4, 151936)])
@pytest.mark.parametrize("scale", [1.0, 20.0, 60.0])
@pytest.mark.parametrize("write_probs", [False, True])
def test_softmax_stats_equals_its_twin(dtype, rows, vocab, scale, write_probs):
    z, targets = random_logits(rows, vocab, scale, dtype)
    twin_z = z.clone()
    want = chunk_stats(twin_z, targets, torch.empty_like(z), write_probs)
    got_z = z.cuda()
    got = kernel().softmax_stats(got_z, targets.cuda(), write_probs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, **tolerance(dtype, scale))
    if write_probs:  # the row is its softmax, as the twin leaves it
        torch.testing.assert_close(got_z.cpu(), twin_z, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-6)


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 7), (5, 513), (64, 32000), (4, 151936), (70000, 3)])
@pytest.mark.parametrize("entropy_term", [False, True])
def test_logit_grad_equals_its_twin(dtype, rows, vocab, entropy_term):
    """(70000, 3): more rows than one grid dimension holds (65535), so the kernel's row loop runs."""
    z, targets = random_logits(rows, vocab, 8.0, dtype)
    lse, _, entropy = chunk_stats(z.clone(), targets, torch.empty_like(z), False)
    g = torch.Generator().manual_seed(1)
    up = torch.randn(rows, generator=g, dtype=torch.float64).to(dtype)
    up_h = torch.randn(rows, generator=g, dtype=torch.float64).to(dtype) if entropy_term else None
    want = chunk_grad_(z.clone(), targets, lse, entropy, up, up_h, torch.empty_like(z) if entropy_term else None)
    got = kernel().logit_grad_(*(x.cuda() for x in (z, targets, lse, entropy, up)),
                               None if up_h is None else up_h.cuda())
    torch.testing.assert_close(got.cpu(), want, **tolerance(dtype, 8.0))


@on_gpu
def test_the_kernels_check_their_arguments():
    z, targets = random_logits(3, 10, 1.0, torch.float32)
    ext = kernel()
    with pytest.raises(RuntimeError, match="float32 or float64"):
        ext.softmax_stats(z.cuda().half(), targets.cuda(), False)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.softmax_stats(z.cuda().T, targets.cuda(), False)
    with pytest.raises(RuntimeError, match="targets"):
        ext.softmax_stats(z.cuda(), targets.cuda().int(), False)
    lse = torch.zeros(3, device="cuda")
    with pytest.raises(RuntimeError, match="g must be"):
        ext.logit_grad_(z.cuda(), targets.cuda(), lse, lse, lse.double(), None)
    empty = ext.softmax_stats(torch.empty(0, 10, device="cuda"), torch.empty(0, dtype=torch.long, device="cuda"), False)
    assert [t.shape for t in empty] == [(0,)] * 3


@on_gpu
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_through_the_kernels_equals_the_fp64_definition(recompute, dtype):
    """The whole autograd function on CUDA, kernels loaded: values and gradients of hidden, weight
    and bias for a loss with both terms, a ragged last chunk and a temperature."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 33, 64, generator=g, dtype=torch.float64)
    weight = torch.randn(1000, 64, generator=g, dtype=torch.float64) * 0.3
    bias = torch.randn(1000, generator=g, dtype=torch.float64)
    targets = torch.randint(1000, (4, 33), generator=g)
    up_logp, up_ent = torch.randn(4, 33, generator=g), torch.randn(4, 33, generator=g)
    kernel()
    leaves = [x.to(dtype) for x in (hidden, weight, bias)]  # the inputs as the GPU side sees them
    h, w, b = (x.cuda().requires_grad_() for x in leaves)
    logp, ent = token_logprobs(h, w, targets.cuda(), temperature=0.7, chunk_size=37, bias=b, recompute=recompute)
    got = (logp, ent) + torch.autograd.grad((logp * up_logp.cuda()).sum() + (ent * up_ent.cuda()).sum(), (h, w, b))
    h64, w64, b64 = (x.double().requires_grad_() for x in leaves)
    ref_logp, ref_ent = naive_fp64(h64, w64, targets, temperature=0.7, bias=b64)
    ref = (ref_logp, ref_ent) + torch.autograd.grad((ref_logp * up_logp).sum() + (ref_ent * up_ent).sum(),
                                                    (h64, w64, b64))
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16 inputs get bf16 gradients
    for name, a, r in zip(("logp", "entropy", "d hidden", "d weight", "d bias"), got, ref):
        torch.testing.assert_close(a.cpu().double(), r.detach(), rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@on_gpu
def test_the_kernels_and_the_twins_give_the_same_training_gradients(monkeypatch):
    """The switch a user has (RLCORE_CUDA_KERNELS=0) changes speed, not results: the same fp32
    inputs on the GPU through kernels and through twins, at Qwen's vocabulary (recomputed)."""
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(2, 300, 128, generator=g) * 0.5
    w0 = torch.randn(151936, 128, generator=g) * 0.05
    targets = torch.randint(151936, (2, 300), generator=g).cuda()
    results = []
    for setting in ("1", "0"):
        monkeypatch.setenv("RLCORE_CUDA_KERNELS", setting)
        h, w = h0.cuda().requires_grad_(), w0.cuda().requires_grad_()
        logp, ent = token_logprobs(h, w, targets, chunk_size=256, recompute=True)
        results.append((logp, ent) + torch.autograd.grad(logp.sum() + 0.1 * ent.sum(), (h, w)))
    assert cuda._loaded["token_logprobs"] is not None  # the first pass did use the kernels
    for name, a, b in zip(("logp", "entropy", "d hidden", "d weight"), *results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------- decode attention on a GPU

def attention_kernel():
    ext = cuda.kernels("decode_attention", torch.device("cuda"))
    assert ext is not None, "the decode-attention kernel did not build (see the warning)"
    return ext


def fp64_decode_attention(q, k, v, start, end):
    """softmax(q k^T / sqrt(D)) v over slots start[b]..end[b]-1 of each row, query head h on kv head
    h // (Hq / Hkv), in fp64, one (row, head) at a time: the definition."""
    B, Hq, _, D = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros(B, Hq, 1, D, dtype=torch.float64)
    for b in range(B):
        keys = slice(int(start[b]), int(end[b]))
        for h in range(Hq):
            scores = k[b, h // group, keys].double() @ q[b, h, 0].double() / D ** 0.5
            out[b, h, 0] = scores.softmax(0) @ v[b, h // group, keys].double()
    return out


def cache_layer(B, Hkv, S, D, dtype, g):
    """Layer 1 of a 3-layer cache [L, B, Hkv, S, D], as the engine hands a layer to attention."""
    k = torch.randn(3, B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(3, B, Hkv, S, D, generator=g).to(dtype)
    return k.cuda()[1], v.cuda()[1]


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,Hq,Hkv,S,D", [
    (1, 1, 1, 1, 16), (3, 4, 4, 37, 32), (5, 14, 2, 300, 64), (2, 32, 2, 1000, 128),  # GQA groups of 1..16
    (4, 8, 1, 70, 256), (3, 6, 3, 129, 80), (64, 14, 2, 576, 64),  # D of 256 and 80; Qwen2.5-0.5B's decode
])
def test_decode_attention_equals_its_twin_and_the_fp64_definition(dtype, B, Hq, Hkv, S, D):
    """Rows of every kind of range: the whole buffer, one slot, left padding, a range ending early."""
    g = torch.Generator().manual_seed(B * S + D)
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype).cuda()
    k, v = cache_layer(B, Hkv, S, D, dtype, g)
    start = torch.randint(0, S, (B,), generator=g)
    end = torch.minimum(start + torch.randint(1, S + 1, (B,), generator=g), torch.tensor(S))
    start[0], end[0] = 0, S
    if B > 1:
        start[1], end[1] = S - 1, S
    got = attention_kernel()(q, k, v, start.cuda(), end.cuda())
    assert got.shape == (B, Hq, 1, D) and got.dtype == dtype
    twin = decode_attention_twin(q, k, v, start.cuda(), end.cuda())
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # bf16: a ulp of output
    torch.testing.assert_close(got.float(), twin.float(), **tol)
    want = fp64_decode_attention(q.cpu(), k.cpu(), v.cpu(), start, end)
    torch.testing.assert_close(got.cpu().double(), want, **tol)


@on_gpu
def test_decode_attention_checks_its_arguments():
    ext = attention_kernel()
    q = torch.randn(2, 4, 1, 16, device="cuda")
    k = v = torch.randn(2, 2, 8, 16, device="cuda")
    ends = torch.tensor([8, 8], device="cuda")
    with pytest.raises(TypeError, match="fp32 or bf16"):
        ext(q.half(), k.half(), v.half(), ends * 0, ends)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ext(torch.randn(2, 3, 1, 16, device="cuda"), k, v, ends * 0, ends)
    with pytest.raises(ValueError, match="start and end must be long"):
        ext(q, k, v, ends.int() * 0, ends.int())
    with pytest.raises(ValueError, match="contiguous D"):
        ext(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, ends * 0, ends)
