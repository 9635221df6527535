"""Optimizer, learning-rate scaling by world size, and warmup + decay schedules."""
from __future__ import annotations

import math
from collections import defaultdict

import torch


def scaled_lr(lr: float, rule: str, world_size: int) -> float:
    """The base lr scaled by world size: none, linear (lr*W) or sqrt (lr*sqrt(W))."""
    factor = {"none": 1.0, "linear": float(world_size), "sqrt": math.sqrt(world_size)}[rule]
    return lr * factor


def optimizer_spec(optim_cfg, lr: float) -> tuple[type[torch.optim.Optimizer], dict]:
    """The configured optimizer class (optim.name) and its keyword arguments at learning rate lr."""
    if optim_cfg.name == "sgd":
        return torch.optim.SGD, dict(lr=lr, momentum=optim_cfg.momentum, weight_decay=optim_cfg.weight_decay)
    cls = torch.optim.AdamW if optim_cfg.name == "adamw" else torch.optim.Adam
    # fused: one kernel per parameter instead of ~10 element-wise passes (the same update; on CPU 6-7x faster
    # on KGAT's embedding tables, where dense Adam over every row dominated the KG phase)
    return cls, dict(lr=lr, betas=tuple(optim_cfg.betas), weight_decay=optim_cfg.weight_decay, fused=True)


def build_optimizer(params, optim_cfg, world_size: int) -> torch.optim.Optimizer:
    """The configured optimizer with the scaled learning rate."""
    cls, kwargs = optimizer_spec(optim_cfg, scaled_lr(optim_cfg.lr, optim_cfg.lr_scaling, world_size))
    return cls(params, **kwargs)


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warmup, then decay."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(max((step - warmup) / max(total - warmup, 1), 0.0), 1.0)
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * decay


def warmup_steps(optim_cfg, steps_per_epoch: int) -> int:
    """Warmup length in optimizer steps: the larger of warmup_steps and warmup_epochs."""
    return max(int(optim_cfg.warmup_steps), int(round(optim_cfg.warmup_epochs * steps_per_epoch)))


def build_scheduler(optimizer, optim_cfg, train_cfg, steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over optimizer steps for the whole run: optim.*'s warmup and decay over train.*'s length."""
    total = steps_per_epoch * train_cfg.epochs
    if train_cfg.max_steps > 0:
        total = min(total, train_cfg.max_steps)
    warm = warmup_steps(optim_cfg, steps_per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warm, total, optim_cfg.schedule, optim_cfg.min_lr_ratio))


def has_fixed_shapes(cls: type[torch.optim.Optimizer]) -> bool:
    """Whether an optimizer class's step has fixed shapes and reads nothing on the host, so that a step graph can
    hold it (trainer/engine/step_graph.py): torch's Adam, AdamW and SGD, or a class whose `fixed_shapes` says so."""
    return getattr(cls, "fixed_shapes", cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD))


def phased(base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """`base` with one state per phase over the same parameters (KGAT's original code keeps one Adam for
    its CF loss and another for its KG loss); set_phase() picks the state the next step() updates."""

    class Phased(base):
        # the base's: a phase is a dict of state tensors swapped on the host between steps, each phase's step
        # graph holding its own
        fixed_shapes = has_fixed_shapes(base)

        def __init__(self, params, phases: tuple[str, ...], **kwargs):
            super().__init__(params, **kwargs)
            self.phase = phases[0]
            self._states = {p: self.state if p == self.phase else defaultdict(dict) for p in phases}

        def phase_states(self) -> list[dict]:
            """Every phase's state (self.state is the current phase's)."""
            self._states[self.phase] = self.state
            return list(self._states.values())

        def set_phase(self, phase: str) -> None:
            self._states[self.phase] = self.state
            self.phase, self.state = phase, self._states[phase]

        def state_dict(self):
            current, out = self.phase, {}
            for p in list(self._states):
                self.set_phase(p)
                out[p] = super().state_dict()
            self.set_phase(current)
            return {"phase": current, "phases": out}

        def load_state_dict(self, state_dict):
            for p, sd in state_dict["phases"].items():
                self.set_phase(p)
                super().load_state_dict(sd)
            self.set_phase(state_dict["phase"])

    Phased.__name__ = Phased.__qualname__ = f"Phased{base.__name__}"
    return Phased


def adam_rows_(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, decoupled: bool,
               grad_scale: torch.Tensor | None = None, kernel=None) -> None:
    """Adam (AdamW when decoupled) on the rows of a sparse gradient only; the other rows and their moments
    wait (lazy, as torch.optim.SparseAdam), so a step costs its rows, not the table. One step count per
    parameter for the bias correction, in the same state keys as Adam's. kernel: a module with the same update
    in one C++ pass, `kernel.adam_rows_` (a recipe's compiled kernels), used for contiguous float32 CPU tables."""
    _count_step(param, state)
    step, (beta1, beta2), lr = float(state["step"]), group["betas"], group["lr"]
    tables = (param, grad._values(), state["exp_avg"], state["exp_avg_sq"])
    if kernel is not None and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                                  for t in tables) and param.dim() == 2:
        kernel.adam_rows_(param, state["exp_avg"], state["exp_avg_sq"], grad._indices()[0].contiguous(),
                          grad._values(), lr, beta1, beta2, group["eps"], group["weight_decay"], decoupled, step,
                          1.0 if grad_scale is None else float(grad_scale))
        return
    grad = grad.coalesce()
    rows, g = grad.indices()[0], grad.values()
    if grad_scale is not None:                # a fused optimizer under a GradScaler: grads still scaled
        g = g / grad_scale.to(g.device)
    x, m, v = _row_moments(param, rows, g, state, group, decoupled, lr)
    denom = (v / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
    param.index_copy_(0, rows, x.addcdiv_(m, denom, value=-lr / (1 - beta1 ** step)))


def _count_step(param: torch.Tensor, state: dict) -> None:
    """A row update's state made at its first step (where fused Adam keeps it: a shared state), its count raised."""
    if not state:
        state["step"] = torch.zeros((), device=param.device)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["step"] += 1


def _row_moments(param: torch.Tensor, rows: torch.Tensor, g: torch.Tensor, state: dict, group: dict,
                 decoupled: bool, lr) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the rows' values, decayed where decoupled; their new first and second moments, written back)."""
    x = param.index_select(0, rows)           # index_select: 1.8x aten::index on a table's rows
    (beta1, beta2), decay = group["betas"], group["weight_decay"]
    if decay:
        if decoupled:
            x.mul_(1 - lr * decay)
        else:
            g = g.add(x, alpha=decay)
    m = state["exp_avg"].index_select(0, rows).mul_(beta1).add_(g, alpha=1 - beta1)
    v = state["exp_avg_sq"].index_select(0, rows).mul_(beta2).addcmul_(g, g, value=1 - beta2)
    state["exp_avg"].index_copy_(0, rows, m)
    state["exp_avg_sq"].index_copy_(0, rows, v)
    return x, m, v


def adam_rows_fixed_(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, decoupled: bool,
                     sums: torch.Tensor, grad_scale: torch.Tensor | None = None) -> None:
    """adam_rows_ in fixed shapes, nothing read by the host (the GPU-shaped step's; a step graph can hold it): the
    gradient's K rows as they come, duplicates and all (no coalesce: its row count is the data's), summed per row
    into SUMS (a zero table of the parameter's shape, kept by the caller) and read back, so a row named twice gets
    the same update twice and is written twice with one value; SUMS is zeroed at those rows again. The step count
    and the bias corrections stay on the device, and the learning rate may be a tensor (a step graph's)."""
    _count_step(param, state)
    step, (beta1, beta2), lr = state["step"], group["betas"], group["lr"]
    # a step graph's learning rate is a tensor: a float is made one too, so that both take the same arithmetic
    # (torch divides a Python float by a tensor as a reciprocal times it) and a run with the graph equals one without
    lr = lr if torch.is_tensor(lr) else torch.tensor(lr, dtype=torch.float64)
    lr_wide, lr = lr.double(), lr.to(param.dtype)
    rows, g = grad._indices()[0], grad._values()
    if grad_scale is not None:                # a fused optimizer under a GradScaler: grads still scaled
        g = g / grad_scale.to(g.device)
    sums.index_put_((rows,), g, accumulate=True)      # deterministic where torch is asked to be (a sort on CUDA)
    g = sums.index_select(0, rows)
    sums.index_fill_(0, rows, 0)
    x, m, v = _row_moments(param, rows, g, state, group, decoupled, lr_wide)
    denom = (v / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
    param.index_copy_(0, rows, x.sub_(m.div_(denom).mul_(lr / (1 - beta1 ** step))))


def sparse_rows(base: type[torch.optim.Optimizer], kernel=None, fixed: bool = False) -> type[torch.optim.Optimizer]:
    """`base` (Adam or AdamW) that also takes sparse gradients (an embedding table's rows): those by
    adam_rows_ (with `kernel`, see there), or by adam_rows_fixed_ where `fixed` (the GPU-shaped step), every dense
    gradient by base.step as before."""
    if not issubclass(base, torch.optim.Adam | torch.optim.AdamW):
        raise ValueError(f"sparse row updates need Adam or AdamW, not {base.__name__}")

    class SparseRows(base):
        fixed_shapes = fixed

        def step(self, closure=None):
            held = [(p, p.grad) for group in self.param_groups for p in group["params"]
                    if p.grad is not None and p.grad.is_sparse]
            for p, _ in held:
                p.grad = None                   # base.step (fused) refuses sparse gradients
            try:
                loss = super().step(closure)
            finally:
                for p, grad in held:
                    p.grad = grad
            found_inf = getattr(self, "found_inf", None)
            if held and not (found_inf is not None and float(found_inf) > 0):     # a GradScaler's skipped step
                self._step_rows(held)
            return loss

        @torch.no_grad()
        def _step_rows(self, held: list) -> None:
            groups = {id(p): group for group in self.param_groups for p in group["params"]}
            decoupled = issubclass(base, torch.optim.AdamW)
            for p, grad in held:
                if not fixed:
                    adam_rows_(p, grad, self.state[p], groups[id(p)], decoupled, getattr(self, "grad_scale", None),
                               kernel)
                    continue
                # the per-row sums' table: the optimizer's, not its state (a checkpoint does not carry it)
                sums = vars(self).setdefault("_row_sums", {})
                if id(p) not in sums:
                    sums[id(p)] = torch.zeros_like(p)
                adam_rows_fixed_(p, grad, self.state[p], groups[id(p)], decoupled, sums[id(p)],
                                 getattr(self, "grad_scale", None))

    SparseRows.__name__ = SparseRows.__qualname__ = f"SparseRows{base.__name__}"
    return SparseRows
