"""asr/vad.py's time map against faster-whisper's SpeechTimestampsMap, on made-up chunks
whose joins the times hit exactly (the real recordings seldom do)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from asr.transcribe import Segment
from asr.vad import SpeechMap
from asr.words import Word

SpeechTimestampsMap = pytest.importorskip("faster_whisper.vad").SpeechTimestampsMap

# Filtered lengths 16384, 8192 and 64000 samples: the joins fall at 1.024 s and 1.536 s.
CHUNKS = ((4096, 20480), (52224, 60416), (96000, 160000))
TIMES = [0.0, 0.5, 1.0, 1.024, 1.04, 1.536, 2.0, 5.536, 7.0]  # 5.536 s: the end; 7.0 past it


def test_times_map_back_as_faster_whispers_do():
    ours, theirs = SpeechMap(CHUNKS), SpeechTimestampsMap([dict(start=s, end=e) for s, e in CHUNKS], 16000)
    assert ours.seconds == 5.536
    for seconds in TIMES:
        for is_end in (False, True):
            chunk = ours.chunk_of(seconds, is_end)
            assert chunk == theirs.get_chunk_index(seconds, is_end), (seconds, is_end)
            assert ours.original(seconds, chunk) == pytest.approx(theirs.get_original_time(seconds, is_end=is_end),
                                                                  abs=0.005)


def test_a_segment_maps_its_ends_and_each_word_by_its_middle():
    """A segment ending at a join ends in the chunk before it; a word keeps both ends in the
    chunk of its middle, so the word across the join at 1.024 s lies wholly in the second,
    and a segment with words spans them, as faster-whisper's do (its own end, 1.28 s, left
    the last word, 3.24-3.34 s, outside it; a first word straddling a join put its start
    before the cut's silence)."""
    words = [Word(" in", 0.9, 1.0, 0.9), Word(" two", 1.0, 1.1, 0.8)]
    bare = Segment(0, 0.9, 1.024, " in two", [1, 2], -0.1, 1.0, 0.0, 0.0)
    restored = SpeechMap(CHUNKS).restore(bare)
    assert (restored.start, restored.end) == (1.156, 1.28)  # 0.256 s cut before the first chunk
    restored = SpeechMap(CHUNKS).restore(replace(bare, words=words))
    assert [(w.start, w.end) for w in restored.words] == [(1.156, 1.256), (3.24, 3.34)]  # 2.24 s cut before the second
    assert (restored.start, restored.end) == (1.156, 3.34)
    assert restored.text == bare.text and restored.tokens == bare.tokens
    straddling = Segment(0, 1.0, 1.3, " two", [2], -0.1, 1.0, 0.0, 0.0, words[1:])  # from the first chunk's end
    restored = SpeechMap(CHUNKS).restore(straddling)
    assert (restored.start, restored.end) == (3.24, 3.34)  # not 1.256: the cut's 2.24 s of silence are not the segment's
