"""The seed guides' `train.py`, run by the trainer with the guide's meaning (trainer/legacy/scripts.py).

    torchrun --nproc_per_node=3 train.py    # seed 003: the mouse-behaviour 3D CNN
"""
import sys

from trainer.legacy.scripts import run

if __name__ == "__main__":
    sys.exit(run("train.py", sys.argv[1:]))
