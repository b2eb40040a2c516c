"""asr/vad.py's time map against faster-whisper's SpeechTimestampsMap, on made-up chunks
whose joins the times hit exactly (the real recordings seldom do)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from asr.audio import load_audio, time_within
from asr.transcribe import Segment
from asr.vad import SpeechMap, speech_only
from asr.words import Word
from conftest import DEV

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
            mapped = theirs.get_original_time(seconds, is_end=is_end)
            # Past the filtered audio's end (no segment is: they are clamped to it), ours stops
            # at the last chunk's end, 10 s; theirs runs on into what follows.
            assert ours.original(seconds, chunk) == pytest.approx(min(mapped, 10.0), abs=0.005)


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
    # A word whose middle is in the first chunk and whose end runs past it keeps its end, as
    # faster-whisper's does (it was cut at the chunk's end, 1.28 s).
    running_on = Segment(0, 0.9, 1.1, " in", [1], -0.1, 1.0, 0.0, 0.0, [Word(" in", 0.9, 1.1, 0.9)])
    theirs = SpeechTimestampsMap([dict(start=s, end=e) for s, e in CHUNKS], 16000)
    restored = SpeechMap(CHUNKS).restore(running_on)
    assert (restored.words[0].start, restored.words[0].end) == (1.156, 1.356)
    assert (1.156, 1.356) == pytest.approx((theirs.get_original_time(0.9, 0), theirs.get_original_time(1.1, 0)), abs=0.005)


def test_a_segment_without_words_ending_in_the_next_chunks_padding_ends_in_its_own():
    """Whisper's end of a segment, 0.1 s past its speech, fell in the next chunk: mapped
    there, a subtitle stretched over the 40 s of silence cut between (faster-whisper's does).
    Within the padding the filter keeps before the next chunk's speech (0.4 s), or a quarter
    second past it (Whisper's end is often at the next speech's onset, or just after: 0.46 s
    into the next chunk missed by 0.06 s, and a cue hung over 5 s of cut silence), it now
    ends where its own chunk does; further in, the speech goes on across the cut. Mirrored,
    a start in a chunk's trailing padding is the next chunk's start."""
    speech = SpeechMap(CHUNKS, pad=6400)
    for end in (1.1, 1.45):  # 0.076 and 0.426 s into the second chunk
        just_past = speech.restore(Segment(0, 0.5, end, " in two", [1, 2], -0.1, 1.0, 0.0, 0.0))
        assert (just_past.start, just_past.end) == (0.756, 1.28)  # not 3.34 or 3.69, after the cut's 2.24 s
    across = speech.restore(Segment(0, 0.3, 2.3, " in two", [1, 2], -0.1, 1.0, 0.0, 0.0))
    assert (across.start, across.end) == (0.556, 6.764)  # 0.764 s into the third chunk, 4.464 s cut before it
    late = speech.restore(Segment(0, 0.9, 2.3, " in two", [1, 2], -0.1, 1.0, 0.0, 0.0))
    assert (late.start, late.end) == (3.264, 6.764)  # not 1.156, 0.124 s before the first chunk's end
    spoken = speech.restore(Segment(0, 0.5, 2.3, " in two", [1, 2], -0.1, 1.0, 0.0, 0.0))
    assert (spoken.start, spoken.end) == (0.756, 6.764)  # 0.524 s before it: in its speech, a short word's
    within = speech.restore(Segment(0, 0.9, 1.45, " in two", [1, 2], -0.1, 1.0, 0.0, 0.0))
    assert (within.start, within.end) == (1.156, 1.28)  # both in padding: its own chunk's


def test_a_rounded_time_never_passes_its_chunks_end():
    """0.1 s cut: 1.0 s in the filtered audio is 1.100625 s in the recording, where the chunk
    ends; rounded to the millisecond that was 1.101 s, after the speech (and, at a recording's
    end, after the recording: CI's 53.267 s segment end of a 53.2665625 s file)."""
    speech = SpeechMap(((1610, 17610),))
    assert speech.original(1.0, 0) == 1.1
    assert time_within(53.2665625, 53.2665625) == 53.266
    assert time_within(53.2665625, 53.2665625, places=2) == 53.26
    assert time_within(53.2664, 53.2665625) == 53.266
    assert time_within(12.0, 53.2665625) == 12.0


def test_quiet_speech_is_found_as_loud_speech_is():
    """Silero's judgement depends on the level, Whisper's does not: JFK peaking at -53 dBFS
    kept 4.3 of its 11 s (the transcript lost its first half), at -60 dBFS nothing. A louder
    recording is judged as faster-whisper's filter judges it."""
    from faster_whisper.vad import VadOptions, get_speech_timestamps

    jfk = load_audio(DEV / "en_short" / "jfk.flac")
    chunks = tuple((c["start"], c["end"]) for c in get_speech_timestamps(jfk, VadOptions(), 16000))
    for gain in (1.0, 0.003, 0.001):
        kept, speech = speech_only(jfk * np.float32(gain))
        assert speech.chunks == chunks and len(kept) == sum(end - start for start, end in chunks), gain
    assert speech_only(np.zeros(16000, np.float32))[1].chunks == ()
    with np.errstate(all="raise"):  # raised at most 60 dB: a peak of 1e-40 overflowed the gain to inf
        assert speech_only(np.full(16000, 1e-40, np.float32))[1].chunks == ()
