"""How well a draft predicts its target: teacher-forced top-1 agreement on the target's
own greedy transcripts (first 30 s window of each clip, end-of-text included).

    python scripts/draft_agreement.py --target packaged:whisper-base --draft bundled:whisper-base-2l \\
        --audio ../shared/eval/dev/manifest.tsv"""

from __future__ import annotations

import argparse
from pathlib import Path

from asr.distill import list_audio, teacher_forced_agreement
from asr.models import load_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--audio", type=Path, required=True, help="folder of audio files or a .tsv manifest")
    parser.add_argument("--language", default="en")
    args = parser.parse_args()
    files = list_audio(args.audio)
    hits, total = teacher_forced_agreement(load_pair(args.target, args.draft), files, args.language)
    print(f"{args.draft} agrees with {args.target} on {hits}/{total} tokens ({hits / total:.1%}) over {len(files)} clips")


if __name__ == "__main__":
    main()
