"""`python -m trainer.native build [--portable] [--portable-only] [--strict] [--cache DIR]`: every C++ extension
built ahead of the first run (`make kernels`, the Dockerfile and apptainer.def run it; without it a CPU run starts
`build --background NAME` behind itself: trainer/native/background.py)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.native.extensions import PORTABLE_ARCH, build_all

parser = argparse.ArgumentParser(prog="python -m trainer.native", allow_abbrev=False,
                                 description="build the C++ extensions ahead of the first run")
parser.add_argument("action", choices=["build"])
parser.add_argument("--portable", action="store_true", help=f"also the portable (-march={PORTABLE_ARCH}) build")
parser.add_argument("--portable-only", action="store_true", help="only the portable build (images)")
parser.add_argument("--strict", action="store_true", help="exit 1 when a build fails (images: no silent fallback)")
parser.add_argument("--cache", type=Path, default=None, metavar="DIR",
                    help="a build cache that outlives $TRAINER_EXTENSIONS_DIR (the Dockerfile's cache mount): builds "
                    "found there are copied instead of compiled, new ones kept there")
parser.add_argument("--background", metavar="NAME", default=None,
                    help="what a run starts when it finds an extension missing (NAME, built first): niced, one build "
                    "at a time, failures recorded for later runs, the builders' lock released at the end")
args = parser.parse_args()
sys.exit(build_all(args.portable, args.portable_only, args.strict, args.cache, args.background))
