"""How well a draft predicts its target: teacher-forced top-1 agreement on the target's
own greedy transcripts (first 30 s window of each clip, end-of-text included).

    python scripts/draft_agreement.py --target packaged:whisper-base --draft bundled:whisper-base-2l \\
        --audio ../shared/eval/dev/manifest.tsv"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from asr.distill import list_audio, teacher_forced_agreement
from asr.models import load_pair
from asr.vocab import language_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--audio", type=Path, required=True, help="folder of audio files or a .tsv manifest")
    parser.add_argument("--language", type=language_code, default="en")
    args = parser.parse_args(argv)
    try:
        files = list_audio(args.audio, args.language)  # before the models load: a mistyped path is told at once
        pair = load_pair(args.target, args.draft)
    except (ValueError, OSError) as error:  # IncompatibleModels is a ValueError
        print(error, file=sys.stderr)
        return 2
    try:
        hits, total, clips = teacher_forced_agreement(pair, files, args.language)
    except ValueError as error:  # a language the target does not know
        print(error, file=sys.stderr)
        return 2
    if not total:
        print(f"{args.audio}: none of its {len(files)} clips could be read (the reasons are above)", file=sys.stderr)
        return 1
    print(f"{args.draft} agrees with {args.target} on {hits}/{total} tokens ({hits / total:.1%}) over {clips} clips"
          + (f" ({len(files) - clips} skipped)" if clips < len(files) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
