"""`python -m app [--host ...] [--port ...] [--preset ...]`: the same as `asr app`."""

import sys

from asr.cli import main

sys.exit(main(["app", *sys.argv[1:]]))
