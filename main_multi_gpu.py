"""The seed guides' `main_multi_gpu.py`, run by the trainer with the guide's meaning (trainer/legacy/scripts.py).

    torchrun --nproc_per_node=4 main_multi_gpu.py --multi-gpu ddp --epochs 20    # seed 002: HAR
"""
import sys

from trainer.legacy.scripts import run

if __name__ == "__main__":
    sys.exit(run("main_multi_gpu.py", sys.argv[1:]))
