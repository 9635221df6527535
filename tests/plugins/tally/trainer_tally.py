"""trainer-tally: a concern added to every run from outside the engine, through the public contract only.

    pip install ./tests/plugins/tally          # found by its entry point (group hpc_trainer.plugins)
    python -m trainer train --recipe har data.synthetic=true tally.stop_at=3 tally.code=70

Its section `tally` (stop_at, code) is set as tally.KEY=VALUE like any other. Each optimizer step it draws one
number from a generator of its own and adds it up; its state (the generator, the sum, the steps counted) goes into
every checkpoint and comes back on resume, so a stopped and resumed run ends with the sum of one that ran through.
At step stop_at it stops the run with its own reason and exit code (a checkpoint first, so that a resume goes on).
At the end rank 0 writes RUN_DIR/tally.json.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from trainer.config.bounds import Bound
from trainer.config.settings import register_section
from trainer.engine.callbacks import Component, StepEnd, Stop, register_component


@dataclass
class TallyConfig:
    """The plugin's own section."""

    bounds: ClassVar[dict[str, Bound]] = dict(stop_at=Bound(0, zero="never"), code=Bound(3, 125))
    stop_at: int = 0              # stop the run at this optimizer step (0: never)
    code: int = 70                # ... with this exit code


class Tally(Component):
    state_key = "tally"

    def __init__(self, trainer):
        self.cfg: TallyConfig = trainer.cfg.tally
        self.path = Path(trainer.cfg.run_dir) / "tally.json"
        self.is_main = trainer.info.is_main
        self.generator = torch.Generator().manual_seed(1234)
        self.total = torch.zeros((), dtype=torch.float64)
        self.steps = 0

    def step_end(self, step: StepEnd) -> Stop | None:
        self.total += torch.rand((), generator=self.generator, dtype=torch.float64)
        self.steps += 1
        if step.step == self.cfg.stop_at:
            return Stop(f"tally: stopped at step {step.step} as tally.stop_at asks", code=self.cfg.code)
        return None

    def state_dict(self) -> dict:
        return dict(generator=self.generator.get_state(), total=self.total.clone(), steps=self.steps)

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.total, self.steps = state["total"].clone(), int(state["steps"])

    def close(self) -> None:
        if self.is_main:
            self.path.write_text(json.dumps(dict(steps=self.steps, total=self.total.item())) + "\n")


register_section("tally", TallyConfig)
register_component(Tally)
