"""`python -m trainer.native build [--portable] [--portable-only] [--strict]`: every C++ extension built ahead of the
first run (`make setup`, the Dockerfile and apptainer.def run it)."""
from __future__ import annotations

import argparse
import sys

from trainer.native.extensions import PORTABLE_ARCH, build_all

parser = argparse.ArgumentParser(prog="python -m trainer.native", allow_abbrev=False,
                                 description="build the C++ extensions ahead of the first run")
parser.add_argument("action", choices=["build"])
parser.add_argument("--portable", action="store_true", help=f"also the portable (-march={PORTABLE_ARCH}) build")
parser.add_argument("--portable-only", action="store_true", help="only the portable build (images)")
parser.add_argument("--strict", action="store_true", help="exit 1 when a build fails (images: no silent fallback)")
args = parser.parse_args()
sys.exit(build_all(args.portable, args.portable_only, args.strict))
