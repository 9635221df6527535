"""The whole optimizer step as one CUDA graph (compile.step_graph=on; issue 70 point 2): the forward, the backward, the
gradient clipping and the optimizer captured together and replayed, so that the host issues one replay per step
instead of a launch per kernel (a small model's step is mostly the host's launches: docs/gpu.md).

    graph = StepGraph(run, closure_of)      # compile.step_graph=on; build_run refused what it cannot capture
    loss = graph.step(batch)                # the batch copied into the graph's inputs, the step replayed

Each batch shape (the epoch's short last batch is a second one) runs WARMUP steps eagerly, on a side stream as torch
asks before a capture, then is captured once and replayed from then on. Every one of these is a real training step
of the same closure, so a run with the graph computes what a run without it does. Needs the GPU-shaped step (fixed
shapes, no host reads), a world of one, no accumulation, no fp16 loss scaling (its inf check reads the device), and
the configured optimizer or a recipe's own in fixed shapes (KGAT's phases and sparse rows on the GPU-shaped step;
each phase is a batch shape of its own). On a CPU there is no graph: `capture` records the closure and `replay` runs
it, so the tests check everything but the capture itself (that the step reads its batch only from the graph's
inputs, the learning rate as a tensor, the recipe's step-time outputs, tensors a host step re-makes).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from trainer.engine.capabilities import GPUShapedStep, of
from trainer.engine.optim import has_fixed_shapes
from trainer.engine.recipe import map_tensors, tensors_of

log = logging.getLogger(__name__)

WARMUP = 2          # eager steps per batch shape before its capture (torch: lazy initialisation, cuBLAS workspaces)


def refusal(run) -> str | None:
    """Why compile.step_graph=on cannot run here, or None."""
    if not of(run.recipe, GPUShapedStep).gpu_shaped:
        return "it needs the GPU-shaped step (fixed shapes, no host reads): set train.gpu_path=on"
    if run.info.world_size > 1 or isinstance(run.wrapped, torch.nn.DataParallel):
        return (f"it captures one process's step; this run has {run.info.world_size} ranks"
                + (" under DataParallel" if isinstance(run.wrapped, torch.nn.DataParallel) else "")
                + ": run one rank per GPU without it")
    if run.accum > 1:
        return f"train.grad_accum_steps={run.accum}: the graph is one whole optimizer step; set it to 1"
    if run.scaler.is_enabled():
        return "fp16's loss scaling checks for infs on the host every step: use train.amp=bf16 (or off)"
    if run.cfg.compile.mode == "reduce-overhead":
        return "compile.mode=reduce-overhead makes CUDA graphs of its own: use compile.mode=default or off"
    if not has_fixed_shapes(type(run.optimizer)):
        return (f"the recipe's own optimizer ({type(run.optimizer).__name__}) is not capturable: "
                f"set compile.step_graph=off")
    return None


class StepGraph:
    """One optimizer step per call, replayed from a graph per batch shape once that shape is warm."""

    def __init__(self, run, closure_of: Callable[[Any], Callable[[], torch.Tensor]]):
        self.run, self.closure_of = run, closure_of
        self.cuda = run.device.type == "cuda"
        self.seen: dict[tuple, int] = {}                     # shape key -> eager steps run
        self.graphs: dict[tuple, tuple[Any, Any, Callable[[], torch.Tensor], dict]] = {}
        self.replays = 0
        self._graph_safe_optimizer()

    def _graph_safe_optimizer(self) -> None:
        """The learning rate as a tensor the scheduler fills in place (a captured step reads it from the device);
        on CUDA the optimizer's step counts on the device too (capturable). float64 on a CPU, where the fused
        kernel reads it as a double, as the float it replaces; float32 on CUDA, as torch's capturable examples."""
        dtype = torch.float32 if self.cuda else torch.float64
        opt = self.run.optimizer
        for group in opt.param_groups:
            lr = group["lr"]
            group["lr"] = torch.tensor(float(lr), dtype=dtype, device=self.run.device if self.cuda else "cpu")
            if self.cuda and "capturable" in group:
                group["capturable"] = True
        if self.cuda:
            for states in getattr(opt, "phase_states", lambda: [opt.state])():
                for state in states.values():
                    if "step" in state and torch.is_tensor(state["step"]):
                        state["step"] = state["step"].to(self.run.device, torch.float32)

    def step(self, batch: Any) -> torch.Tensor:
        """One optimizer step on `batch` (already on the device): the step's loss, on the device."""
        key = shape_key(batch)
        held = self.graphs.get(key)
        if held is None:
            done = self.seen.get(key, 0)
            if done < WARMUP:
                self.seen[key] = done + 1
                return self._eager(batch)
            held = self.graphs[key] = self._capture(batch)
        graph, inputs, _, outputs = held
        copy_into(inputs, batch)
        graph.replay()
        self.replays += 1
        # the recipe's step-time outputs (e.g. classify's hits) name the graph's outputs, refreshed by each replay
        vars(self.run.recipe).update(outputs["recipe"])
        return outputs["loss"]

    def _eager(self, batch: Any) -> torch.Tensor:
        closure = self.closure_of(batch)
        if not self.cuda:
            return closure()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            loss = closure()
        torch.cuda.current_stream().wait_stream(side)
        return loss

    def _capture(self, batch: Any):
        """The graph of one step on static copies of `batch`'s tensors (the step is not run: replay runs it)."""
        inputs = map_tensors(batch, torch.clone)
        closure = self.closure_of(inputs)
        before = dict(vars(self.run.recipe))
        outputs: dict = {}
        if self.cuda:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs["loss"] = closure()
        else:
            graph = _Recorded(closure, outputs, self.run.recipe)
        outputs["recipe"] = step_outputs(self.run.recipe, before)
        log.info("step graph: batch shape %s captured after %d eager steps%s", shapes_text(batch), WARMUP,
                 "" if self.cuda else " (a CPU: recorded, each replay runs the step)")
        return graph, inputs, closure, outputs

    def summary(self) -> str:
        return f"step graph: {len(self.graphs)} graph(s), {self.replays} replayed step(s)"


class _Recorded:
    """A CPU's stand-in for a CUDA graph: replay runs the recorded closure and names the recipe's outputs it set."""

    def __init__(self, closure: Callable[[], torch.Tensor], outputs: dict, recipe):
        self.closure, self.outputs, self.recipe = closure, outputs, recipe

    def replay(self) -> None:
        before = dict(vars(self.recipe))
        self.outputs["loss"] = self.closure()
        self.outputs["recipe"] = step_outputs(self.recipe, before)


def step_outputs(recipe, before: dict) -> dict:
    """The recipe's tensors that a step set (named anew or replaced): a replay must name them again."""
    return {k: v for k, v in vars(recipe).items() if torch.is_tensor(v) and before.get(k) is not v}


def plain_state(optimizer_state: dict) -> dict:
    """An optimizer's state_dict as a run without the graph writes it (the learning rate a float, not capturable):
    its checkpoint resumes with or without compile.step_graph, on either device. KGAT's phases: each phase's."""
    for phase_state in optimizer_state.get("phases", {}).values():
        plain_state(phase_state)
    for group in optimizer_state.get("param_groups", ()):
        if torch.is_tensor(group.get("lr")):
            group["lr"] = float(group["lr"])
        if group.get("capturable"):
            group["capturable"] = False
    return optimizer_state


def shape_key(batch: Any) -> tuple:
    """What a graph is specific to: every tensor's shape, dtype and device, and every other leaf's value."""
    if torch.is_tensor(batch):
        return ("t", tuple(batch.shape), str(batch.dtype), str(batch.device))
    if isinstance(batch, dict):
        return ("d",) + tuple((k, shape_key(v)) for k, v in sorted(batch.items()))
    if isinstance(batch, (list, tuple)):
        return (type(batch).__name__,) + tuple(shape_key(v) for v in batch)
    return ("v", batch)


def shapes_text(batch: Any) -> str:
    return "[" + ", ".join("x".join(map(str, t.shape)) or "scalar" for t in tensors_of(batch)) + "]"


def copy_into(static: Any, batch: Any) -> None:
    for s, b in zip(tensors_of(static), tensors_of(batch)):
        s.copy_(b, non_blocking=True)
