"""``python -m mqa_byoc.kernels [options]``: the same as ``mqa-byoc build-kernels [options]``."""

import sys

from mqa_byoc.cli import main

if __name__ == "__main__":
    sys.exit(main(["build-kernels", *sys.argv[1:]]))
