"""Fused CPU kernels for mHC (mhc_ops.cpp), compiled on first use and cached; the PyTorch path is used where
they cannot be built (no C++ compiler or ninja) or do not apply (GPU tensors, dtypes other than float32).

    ops = mhc_ops()                     # None: not available here (the reason is in unavailable_reason())
    connection = FusedConnection()      # one per mHC sub-layer call; see model.Sublayer

Why a C++ extension: with n = 4 streams of width 50, mHC's cost is element-wise passes over the n-times-wider
residual stream (mixing, gates, their gradients), which PyTorch runs as batched 4x4 matmuls and broadcast
temporaries; torch.compile made the epoch no faster on this CPU (README, SASRec benchmark).

The build is cached per source, torch version and CPU (the code is compiled with -march=native) under
$TRAINER_EXTENSIONS_DIR, else ~/.cache/hpc-trainer/extensions; each process builds in its own temporary
folder and moves the library into place, so a build killed half-way leaves no lock behind for the next run.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("mhc_ops.cpp")
NAME = "seqrec_mhc_ops"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]          # -fopenmp: at::parallel_for is inline OpenMP
_state: dict = {}


def cache_root() -> Path:
    return Path(os.environ.get("TRAINER_EXTENSIONS_DIR") or Path.home() / ".cache" / "hpc-trainer" / "extensions")


def build_key() -> str:
    """What a cached build depends on: the source, torch, the compiler flags and this CPU (-march=native)."""
    cpu = ""
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        cpu = platform.processor()
    parts = [SOURCE.read_bytes(), torch.__version__.encode(), " ".join(CFLAGS).encode(), cpu.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(target: Path):
    from torch.utils.cpp_extension import load
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
    try:
        module = load(NAME, [str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], build_directory=str(tmp),
                      verbose=False)
        os.replace(module.__file__, target)         # atomic: a concurrent build's result is the same library
        return module
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def mhc_ops():
    """The compiled module, or None (once per process: a failed build is not retried, and warned about once)."""
    if "ops" not in _state:
        _state["ops"], _state["why"] = None, ""
        target = cache_root() / build_key() / f"{NAME}.so"
        try:
            _state["ops"] = _import(target) if target.exists() else _build(target)
        except Exception as e:           # noqa: BLE001 - any build failure means the PyTorch path
            _state["why"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            warnings.warn(f"mHC fused CPU kernels unavailable ({_state['why']}); using the PyTorch path "
                          "(same results, slower). model.mhc_fused=false silences this.", stacklevel=2)
    return _state["ops"]


def unavailable_reason() -> str:
    return _state.get("why", "")


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels can take these tensors (CPU, float32)."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


class FusedConnection:
    """One mHC sub-layer call's backward state, shared by its two functions below. The streams x feed the
    maps (_Maps: projection, gates, Sinkhorn, pre-mix) and the stream mix; autograd would write one (N, n, D)
    gradient for each and add them. Instead the stream mix leaves its output gradient here and returns none
    for x, and _Maps' backward, which autograd runs last (its outputs feed the stream mix), writes x's whole
    gradient in one pass."""

    def __init__(self, n: int):
        self.n = n
        self.grad_out = self.pre = None
        self.iterations = 0

    def maps(self, x, weight, alpha, b_pre, b_post, b_res, eps, iters, tol):
        """(h, post, res) for (N, n, D) streams: the pre-mixed input, H_post and H_res; sets self.pre (H_pre,
        without gradient: it acts only through h) and self.iterations (the Sinkhorn's)."""
        return _Maps.apply(x, weight, alpha, b_pre, b_post, b_res, eps, iters, tol, self)

    def stream_mix(self, res, x, post, y):
        return _StreamMix.apply(res, x, post, y, self)


class _Maps(torch.autograd.Function):
    """model.MHCMaps and the pre-mix h = sum_i H_pre_i x_i, in two kernels and a matmul around the Sinkhorn
    kernel; the backward completes x's gradient (FusedConnection)."""

    @staticmethod
    def forward(ctx, x, weight, alpha, b_pre, b_post, b_res, eps, iters, tol, conn):
        weight, gates = weight.float(), [float(v) for v in alpha]
        biases = [v.float().contiguous() for v in (b_pre, b_post, b_res)]
        ops = mhc_ops()
        with torch.autocast(x.device.type, enabled=False):
            a = x.view(x.shape[0], -1) @ weight.t()
        z, r, pre, post, e, h = ops.maps_in(x, a, gates, *biases, eps)
        res, conn.iterations = ops.sinkhorn(e, iters, tol)
        ctx.save_for_backward(x, weight, z, r, pre, post, res)
        ctx.conn, ctx.gates = conn, gates
        conn.pre = pre
        return h, post, res

    @staticmethod
    def backward(ctx, grad_h, grad_post, grad_res):
        x, weight, z, r, pre, post, res = ctx.saved_tensors
        conn, (tokens, n, d) = ctx.conn, x.shape
        grad_h = x.new_zeros(tokens, d) if grad_h is None else grad_h.float().contiguous()
        grad_post = torch.zeros_like(post) if grad_post is None else grad_post.float().contiguous()
        grad_res = torch.zeros_like(res) if grad_res is None else grad_res.float().contiguous()
        grad_out = torch.zeros_like(x) if conn.grad_out is None else conn.grad_out   # (no gradient came)
        ops = mhc_ops()
        grad_l = ops.sinkhorn_backward(res, grad_res)
        ga, coef, grad_u, grad_v = ops.maps_in_backward(x, z, r, pre, post, ctx.gates, grad_post, grad_l, grad_h)
        grad_x = (ga @ weight).view_as(x)
        ops.stream_grad_(grad_x, x, coef, grad_out, res, pre, grad_h)
        ctx.conn = conn.grad_out = conn.pre = None
        grad_l = grad_l.view(tokens, -1)
        grad_alpha = torch.stack([(grad_u * z[:, :n]).sum(), (grad_v * z[:, n:2 * n]).sum(),
                                  (grad_l * z[:, 2 * n:]).sum()])
        return (grad_x, ga.t() @ x.view(tokens, -1), grad_alpha, grad_u.sum(0), grad_v.sum(0),
                grad_l.sum(0).view(n, n), None, None, None, None)


class _StreamMix(torch.autograd.Function):
    """H_res x + H_post^T y (model.StreamMix)."""

    @staticmethod
    def forward(ctx, res, x, post, y, conn):
        res, post, y = res.float().contiguous(), post.float().contiguous(), y.float().contiguous()
        ctx.save_for_backward(res, x, post, y)
        ctx.conn = conn
        return mhc_ops().stream_mix(res, x, post, y)

    @staticmethod
    def backward(ctx, grad):
        res, x, post, y = ctx.saved_tensors
        grad = grad.float().contiguous()
        ctx.conn.grad_out = grad
        ctx.conn = None
        grad_res, grad_post, grad_y = mhc_ops().stream_mix_backward(grad, x, post, y)
        return grad_res, None, grad_post, grad_y, None
