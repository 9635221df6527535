"""The seed guides' `main.py`, run by the trainer with the guide's meaning (trainer/legacy/scripts.py).

    python main.py --dataset=ml-1m --maxlen 200 --no_mhc      # seed 001: TiSASRec on ml-1m
    python main.py --lr 1e-3 --batch-size 32                   # seed 002: HAR
"""
import sys

from trainer.legacy.scripts import run

if __name__ == "__main__":
    sys.exit(run("main.py", sys.argv[1:]))
