"""Transcribe a folder tree: `python scripts/transcribe_folder.py IN_DIR OUT_DIR [options]`.

The same as `asr transcribe IN_DIR --out-dir OUT_DIR [options]` (every option of
`asr transcribe` applies: --formats, --batch-size, --ray [ADDRESS], ...): the output tree
mirrors the input tree, finished files are skipped on a re-run, failures go to
OUT_DIR/errors.jsonl, and the exit status is 1 when any file failed.
`python scripts/transcribe_folder.py --help` lists those options.
"""

from __future__ import annotations

import sys

from asr.cli import main

if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__.strip() + "\n")
        sys.exit(main(["transcribe", "--help"]))
    if len(sys.argv) < 3 or sys.argv[1].startswith("-") or sys.argv[2].startswith("-"):
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(2)
    in_dir, out_dir, *rest = sys.argv[1:]
    sys.exit(main(["transcribe", in_dir, "--out-dir", out_dir, *rest]))
