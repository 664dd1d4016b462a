"""``python -m launcher.tiny_model OUT_DIR [--overwrite]``: build the tiny checkpoint."""

import argparse

from launcher.tiny_model import build_tiny_model

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("out_dir")
parser.add_argument("--overwrite", action="store_true")
args = parser.parse_args()
print(build_tiny_model(args.out_dir, overwrite=args.overwrite))
