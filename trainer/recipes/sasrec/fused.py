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
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd"]
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
        module = load(NAME, [str(SOURCE)], extra_cflags=CFLAGS, build_directory=str(tmp), verbose=False)
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
    """One mHC sub-layer call's backward state, shared by its three functions below. The streams x feed the
    maps' projection, the pre-mix and the stream mix; autograd would write three (N, n, D) gradients and add
    them. Instead the pre-mix and the stream mix leave their parts here and return no gradient for x, and the
    projection's backward, which autograd runs last (its output feeds both), writes x's whole gradient in one
    pass."""

    def __init__(self, n: int):
        self.n = n
        self.grad_out = self.res = self.pre = self.grad_h = None

    def norm_proj(self, flat, weight, eps):
        return _NormProj.apply(flat, weight, eps, self)

    def pre_mix(self, x, pre):
        return _PreMix.apply(x, pre, self)

    def stream_mix(self, res, x, post, y):
        return _StreamMix.apply(res, x, post, y, self)


class _NormProj(torch.autograd.Function):
    """z = RMSNorm(x) W^T as r (x W^T) (model.NormProj); its backward completes x's gradient."""

    @staticmethod
    def forward(ctx, x, weight, eps, conn):
        weight = weight.float()
        with torch.autocast(x.device.type, enabled=False):
            r = torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps))
            a = x @ weight.t()
        ctx.save_for_backward(x, weight, r, a)
        ctx.conn = conn
        return a * r

    @staticmethod
    def backward(ctx, grad):
        x, weight, r, a = ctx.saved_tensors
        conn = ctx.conn
        grad = grad.float()
        grad_a = grad * r
        coef = ((grad * a).sum(-1, keepdim=True) * r.pow(3) / -x.shape[-1]).view(-1)
        tokens, width = x.shape[0], weight.shape[1]
        n = conn.n
        grad_x = (grad_a @ weight).view(tokens, n, width // n)
        if conn.grad_out is None:          # the output's gradient never came (a branch without gradient)
            conn.grad_out, conn.res = torch.zeros_like(grad_x), grad_x.new_zeros(tokens, n, n)
        if conn.grad_h is None:
            conn.pre, conn.grad_h = grad_x.new_zeros(tokens, n), grad_x.new_zeros(tokens, width // n)
        mhc_ops().stream_grad_(grad_x, x.view_as(grad_x), coef, conn.grad_out, conn.res, conn.pre, conn.grad_h)
        ctx.conn = conn.grad_out = conn.grad_h = conn.res = conn.pre = None
        return grad_x.view_as(x), grad_a.t() @ x, None, None


class _PreMix(torch.autograd.Function):
    """h = sum_i pre_i x_i for (N, n, D) streams x and (N, n) pre."""

    @staticmethod
    def forward(ctx, x, pre, conn):
        pre = pre.float().contiguous()
        ctx.save_for_backward(x, pre)
        ctx.conn = conn
        return mhc_ops().pre_mix(x, pre)

    @staticmethod
    def backward(ctx, grad_h):
        x, pre = ctx.saved_tensors
        grad_h = grad_h.float().contiguous()
        ctx.conn.pre, ctx.conn.grad_h = pre, grad_h
        ctx.conn = None
        return None, mhc_ops().pre_mix_backward(x, grad_h), None


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
        ctx.conn.grad_out, ctx.conn.res = grad, res
        ctx.conn = None
        grad_res, grad_post, grad_y = mhc_ops().stream_mix_backward(grad, x, post, y)
        return grad_res, None, grad_post, grad_y, None
