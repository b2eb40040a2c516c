"""Word timestamps: when each word of a window's segments is heard, from the target's
cross-attention (openai/whisper's method). One pass of the target over the window's text
gives, at the model's alignment heads, how much each token attends to each 20 ms of audio;
normalised and median-filtered, that matrix is aligned to the tokens by dynamic time
warping, and a word starts where the path reaches its first token. The pass also gives
each word's probability (its tokens' mean)."""

from __future__ import annotations

import re
import string
import unicodedata
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from asr.audio import time_within
from asr.models import WhisperModel

SECONDS_PER_POSITION = 0.02  # one encoder output position
MEDIAN_FILTER_WIDTH = 7
PREPENDED = "\"'“¿([{-"  # punctuation that joins the word after it
APPENDED = "\"'.。,，!！?？:：”)]}、"  # punctuation that joins the word before it
SENTENCE_ENDS = ".。!！?？"
# Languages written without spaces: a word is each character (or undivided token).
UNSPACED = {"zh", "ja", "th", "lo", "my", "yue"}

# Scripts written without spaces between words: Thai, Lao, Myanmar, Khmer, CJK punctuation,
# kana, CJK ideographs, full-width forms.
UNSPACED_SCRIPTS = re.compile("[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff"
                              "\uf900-\ufaff\uff00-\uffef]")


SPACED_WORD = re.compile(r"\s*\S+")
NOT_WORD = re.compile(r"[^\w']+")


def split_words(text: str) -> list[str]:
    """Words with their leading spaces; in scripts written without spaces (Chinese, Japanese,
    Thai...) each character is one, so that two texts agree on a clause's first characters,
    not only on the whole clause."""
    return [piece for word in SPACED_WORD.findall(text) for piece in cut_unspaced(word, 1, lines=False)]


def word_key(word: str) -> str:
    """What two texts must agree on for a word: the word, not its case or punctuation
    (which Whisper revises as the sentence goes on)."""
    return NOT_WORD.sub("", word.lower()) or word.strip()


def word_keys(text: str) -> list[str]:
    return [word_key(piece) for piece in split_words(text)]


def keys_of_words(keys: list[str], words: int) -> int:
    """How many of these word keys make `words` words: twice as many where most are characters
    of a script written without spaces (split_words), about two to a Chinese word."""
    unspaced = sum(len(key) == 1 and UNSPACED_SCRIPTS.match(key) is not None for key in keys)
    return 2 * words if 2 * unspaced > len(keys) else words


def copied_at(keys: list[str], before: list[str], run: int) -> int | None:
    """Where keys first repeat `run` words in a row of `before` (both word keys), if they do:
    how the decoders tell a copy of the text before a window from new speech."""
    runs = {tuple(before[i : i + run]) for i in range(len(before) - run + 1)}
    return next((i for i in range(len(keys) - run + 1) if tuple(keys[i : i + run]) in runs), None)


def columns(text: str) -> int:
    """The width of text on a screen: a Chinese, Japanese or Korean character (East Asian
    wide or full-width) takes two columns, a combining mark none, any other character one."""
    return sum(_columns(char) for char in text)


def shared_times(start: float, end: float, parts: list[str], size: Callable[[str], int] = len) -> list[tuple[float, float]]:
    """[start, end] shared among parts said in turn, each by the size of its text without
    spaces (len: characters; columns: as wide as on a screen), the last ending at end."""
    sizes = [size(part.strip()) for part in parts]
    total, done, times = sum(sizes), 0, []
    for part_size in sizes:
        begin = start + (end - start) * done / total if total else start
        done += part_size
        times.append((begin, end if done == total else start + (end - start) * done / total))
    return times


def _columns(char: str) -> int:
    if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me"):
        return 0
    return 2 if unicodedata.east_asian_width(char) in "WF" else 1


def cut_unspaced(word: str, width: int, lines: bool = True) -> list[str]:
    """A word (text between spaces) wider than `width` columns: where it holds a script
    written without spaces, pieces of at most `width` columns, cut where a line may break
    (joined, lines; without lines, between any two characters but a combining mark and the
    one it marks; a wider unit is a piece of its own), the leading space with the first;
    other words (a long name, a URL) stay whole."""
    text = word.lstrip()
    if columns(text) <= width or not UNSPACED_SCRIPTS.search(text):
        return [word]
    pieces = [word[: len(word) - len(text)]]  # the leading space goes with the first piece
    used = 0
    for unit in _unbroken(text, lines):
        wide = columns(unit)
        if used and used + wide > width:
            pieces.append("")
            used = 0
        pieces[-1] += unit
        used += wide
    return pieces


def _unbroken(text: str, lines: bool = True) -> list[str]:
    """Text as the units a line may break between (joined; lines False: only marks)."""
    units: list[str] = []
    for char in text:
        if units and (_marks(units[-1][-1], char) or lines and joined(units[-1][-1], char)):
            units[-1] += char
        else:
            units.append(char)
    return units


def _marks(before: str, char: str) -> bool:
    """Whether char belongs to the character before it: a combining mark (Thai's vowel and
    tone marks, Khmer's and Myanmar's spacing vowel signs), or a consonant stacked under the
    one before by a coeng or virama."""
    return _columns(char) == 0 or unicodedata.category(char) == "Mc" or unicodedata.combining(before) == 9


NO_LINE_START = frozenset("ぁぃぅぇぉっゃゅょゎゕゖァィゥェォッャュョヮヵヶㇰㇱㇲㇳㇴㇵㇶㇷㇸㇹㇺㇻㇼㇽㇾㇿーｧｨｩｪｫｯｬｭｮｰ")


def joined(before: str, char: str) -> bool:
    """Whether a line may not break between these two characters: inside a run of letters
    and digits of a script written with spaces ("Google" in Japanese) or of digits ("１００"),
    before punctuation that closes ("，", "。", "」"), after punctuation that opens ("「", "（"),
    or inside a character with its marks; nor before Japanese small kana or the long-vowel
    mark ("しょ", "ラー": a line starting "ょうか" is against Japanese line breaking, JLReq)."""
    kind, was = unicodedata.category(char), unicodedata.category(before)
    return (_marks(before, char) or kind in ("Pe", "Pf", "Po") or was in ("Ps", "Pi") or char in NO_LINE_START
            or kind == was == "Nd" or not (UNSPACED_SCRIPTS.match(char) or UNSPACED_SCRIPTS.match(before)))


@dataclass(frozen=True)
class Word:
    text: str  # leading space included
    start: float  # seconds from the start of the recording
    end: float
    probability: float

    @property
    def word(self) -> str:
        """text, by faster-whisper's name for it (and the JSON's key): w.word raised AttributeError."""
        return self.text


@dataclass
class _Timed:
    text: str
    tokens: list[int]
    start: float
    end: float
    probability: float


def anomalous(words: list[Word]) -> bool:
    """Whether a segment's timed words look hallucinated, by Whisper's measure (its
    hallucination_silence_threshold): of its first 8 words but bare punctuation, improbable
    ones (under 0.15) and ones said too fast (under 0.133 s) or too slowly (over 2 s) score,
    and a segment scoring 3, or about one a word, is anomalous."""
    scored = [w for w in words if w.text not in PREPENDED + APPENDED][:8]
    score = 0.0
    for word in scored:
        duration = word.end - word.start
        score += (word.probability < 0.15) + max(0.0, 0.133 - duration) * 15 + max(0.0, duration - 2.0)
    return score >= 3 or score + 0.01 >= len(scored)


def align(model: WhisperModel, encoded: torch.Tensor, sot_sequence: list[int], segments: list[list[int]],
          times: list[tuple[float, float]], content_frames: int, offset: float, language: str, duration: float,
          last_speech: float) -> tuple[list[list[Word]], list[tuple[float, float]], float]:
    """The words of each segment of one window (its text tokens, its start and end), each
    segment's start and end moved to its words' as Whisper moves them, and where the
    window's speech ends, for the next window (its start and its align's last_speech):
    encoded [positions, width] is the window's encoder output, content_frames the mel frames
    of audio in it, offset the window's start and duration the decoded audio's, in seconds;
    last_speech: where the speech of the recording's windows before ended.
    Timed as openai/whisper times them: punctuation joined to its word, a word much longer
    than the median cut at a sentence end, and a segment's first and last words kept from
    running far past its own start and end; here then cut to the segment (Whisper's can
    start before it, or end past it and past the recording), while the speech's end, which
    moves the next window, stays Whisper's last word's (faster-whisper's windows, so)."""
    text = [t for segment in segments for t in segment]
    if not text:
        return [[] for _ in segments], times, times[-1][1] if times else last_speech
    if content_frames < 4:
        # Under two encoder positions to time words in (one makes the scores' spread 0, and
        # them NaN): every word at the window's start, as faster-whisper's alignment puts
        # them, so the segments take no time and are dropped. Whisper fills so short a last
        # window with a copy of the previous text, which was kept.
        return [[] for _ in segments], [(offset, offset)] * len(segments), offset if segments else last_speech
    vocab = model.vocab
    tokens = torch.tensor([sot_sequence + [vocab.no_timestamps] + text + [vocab.eot]], device=encoded.device)
    heads = alignment_heads(model)
    logits, scores = model.runner.cross_attention_scores(tokens, encoded[None], {layer for layer, _ in heads})
    probabilities = logits[0, len(sot_sequence) : -1, : vocab.eot].float().softmax(-1)
    token_probability = probabilities[torch.arange(len(text)), torch.tensor(text, device=encoded.device)].tolist()

    weights = torch.stack([scores[layer][0, head] for layer, head in heads]).float()
    weights = weights[:, :, : content_frames // 2].softmax(-1)  # two mel frames per encoder position
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = _median_filter((weights - mean) / std, MEDIAN_FILTER_WIDTH)
    matrix = weights.mean(0)[len(sot_sequence) : -1]  # a row per prediction: each text token, then end-of-text
    token_index, position = _dtw(-matrix.double().cpu().numpy())
    jumps = np.diff(token_index, prepend=-1).astype(bool)  # where the path reaches each token
    reached = position[jumps] * SECONDS_PER_POSITION  # the time of each token

    words = _words(vocab, text, language)
    bounds = np.cumsum([0] + [len(tokens) for _, tokens in words])
    timed = [_Timed(word, tokens, float(reached[a]), float(reached[b]), float(np.mean(token_probability[a:b])))
             for (word, tokens), a, b in zip(words, bounds[:-1], bounds[1:])]
    durations = [t.end - t.start for t in timed if t.end > t.start]
    median = min(0.7, float(np.median(durations))) if durations else 0.0
    _cut_long_words_at_sentence_ends(timed, 2 * median)
    _join_punctuation(timed)
    words = _per_segment(timed, segments, offset, duration)
    fitted, speech = _fitted(words, times, median, last_speech, duration)
    return [[Word(w.text, w.start, w.end, w.probability) for w in segment] for segment in words], fitted, speech


def _fitted(words: list[list[_Timed]], times: list[tuple[float, float]], median: float, last_speech: float,
            duration: float) -> tuple[list[tuple[float, float]], float]:
    """Each segment's start and end fitted to its words (_fit_to_segment), its words then cut
    to it; and where the speech ends as Whisper has it: its last word's end before that cut,
    else the last segment's end."""
    fitted, spoken = [], None
    for segment, (start, end) in zip(words, times):
        if segment:
            start, end = _fit_to_segment(segment, start, end, median, last_speech)
            last_speech, spoken = end, segment[-1].end
            within = time_within(end, duration)
            for word in segment:
                word.start, word.end = (min(max(t, start), within) for t in (word.start, word.end))
        fitted.append((start, end))
    return fitted, spoken if spoken is not None else fitted[-1][1] if fitted else last_speech


def alignment_heads(model: WhisperModel) -> list[tuple[int, int]]:
    """The (layer, head) pairs whose cross-attention follows the speech: the model's own
    list where it has one, else every head of the second half of the layers (Whisper's
    default)."""
    if model.alignment_heads:
        return model.alignment_heads
    layers, heads = model.config.decoder_layers, model.config.decoder_attention_heads
    return [(layer, head) for layer in range(layers // 2, layers) for head in range(heads)]


def _median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Along the last dimension, edges reflected."""
    if x.shape[-1] <= width // 2:
        return x
    rows = x.reshape(1, -1, x.shape[-1])
    padded = F.pad(rows, (width // 2, width // 2), mode="reflect")[0]
    return padded.unfold(-1, width, 1).median(-1).values.view(x.shape)


def _dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through cost [tokens, positions] from its first cell to its
    last, each step one token, one position or both; returns the path's (token, position)
    indices. Each anti-diagonal depends only on the two before it, so they are computed
    one at a time, vectorised."""
    n, m = cost.shape
    total = np.full((n + 1, m + 1), np.inf, dtype=np.float32)  # float32 sums, as openai/whisper's (ties)
    total[0, 0] = 0.0
    step = np.zeros((n + 1, m + 1), dtype=np.int8)  # 0: both, 1: a token, 2: a position
    for d in range(2, n + m + 1):
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        both, token, position = total[i - 1, j - 1], total[i - 1, j], total[i, j - 1]
        choice = np.where((both < token) & (both < position), 0, np.where((token < both) & (token < position), 1, 2))
        total[i, j] = cost[i - 1, j - 1] + np.choose(choice, [both, token, position])
        step[i, j] = choice
    step[0, :], step[:, 0] = 2, 1
    path = []
    i, j = n, m
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        move = step[i, j]
        i, j = i - (move != 2), j - (move != 1)
    indices = np.array(path[::-1]).T
    return indices[0], indices[1]


def _words(vocab, tokens: list[int], language: str) -> list[tuple[str, list[int]]]:
    """Tokens grouped into words: whole characters first (a character's UTF-8 bytes may span
    tokens), then, where words are spaced, characters joined until a space or punctuation."""
    characters: list[tuple[str, list[int]]] = []
    pending: list[int] = []
    full, offset = vocab.decode(tokens), 0
    for token in tokens:
        pending.append(token)
        piece = vocab.decode(pending)
        broken = piece.find("\ufffd")
        if broken < 0 or full[offset + broken : offset + broken + 1] == "\ufffd":
            characters.append((piece, pending))
            pending, offset = [], offset + len(piece)
    if language in UNSPACED:
        return characters
    words: list[tuple[str, list[int]]] = []
    for piece, group in characters:
        if not words or piece.startswith(" ") or piece.strip() in string.punctuation:
            words.append((piece, list(group)))
        else:
            words[-1] = (words[-1][0] + piece, words[-1][1] + group)
    return words


def _cut_long_words_at_sentence_ends(timed: list[_Timed], longest: float) -> None:
    """A sentence's last punctuation (or the word after it) can take in a pause: such a
    word is cut to `longest` (twice the median word's duration, at most 1.4 s)."""
    for before, word in zip(timed, timed[1:]):
        if word.end - word.start > longest:
            if word.text in SENTENCE_ENDS:
                word.end = word.start + longest
            elif before.text in SENTENCE_ENDS:
                word.start = word.end - longest


def _join_punctuation(timed: list[_Timed]) -> None:
    """Opening punctuation joins the word after it, closing punctuation the word before it;
    the punctuation's own entry is left empty (its tokens moved)."""
    following = len(timed) - 1
    for i in range(len(timed) - 2, -1, -1):
        word = timed[i]
        if word.text.startswith(" ") and word.text.strip() in PREPENDED:
            after = timed[following]
            after.text, after.tokens = word.text + after.text, word.tokens + after.tokens
            word.text, word.tokens = "", []
        else:
            following = i
    previous = 0
    for i in range(1, len(timed)):
        word = timed[i]
        before = timed[previous]
        if not before.text.endswith(" ") and word.text in APPENDED:
            before.text, before.tokens = before.text + word.text, before.tokens + word.tokens
            word.text, word.tokens = "", []
        else:
            previous = i


def _per_segment(timed: list[_Timed], segments: list[list[int]], offset: float, duration: float) -> list[list[_Timed]]:
    """The words of each segment, in seconds from the recording's start (at most its
    duration): a segment takes words until it has used its tokens."""
    result, index = [], 0
    for segment in segments:
        words, used = [], 0
        while index < len(timed) and used < len(segment):
            word = timed[index]
            if word.text:
                start, end = (time_within(offset + t, duration, 2) for t in (word.start, word.end))
                words.append(_Timed(word.text, word.tokens, start, end, word.probability))
            used += len(word.tokens)
            index += 1
        result.append(words)
    return result


def _fit_to_segment(words: list[_Timed], start: float, end: float, median: float,
                    last_speech: float) -> tuple[float, float]:
    """A segment's first word after a pause, or its first and last words, can take in
    silence: they are cut back towards the segment's own start and end; otherwise the
    segment takes its words' start and end. Returns the segment's start and end."""
    longest = 2 * median
    first = words[0]
    if first.end - last_speech > 4 * median and (
        first.end - first.start > longest or (len(words) > 1 and words[1].end - first.start > 2 * longest)
    ):
        if len(words) > 1 and words[1].end - words[1].start > longest:
            first.end = words[1].start = max(words[1].end / 2, words[1].end - longest)
        first.start = max(0.0, first.end - longest)
    if start < first.end and start - 0.5 > first.start:
        first.start = max(0.0, min(first.end - median, start))
    else:
        start = first.start
    last = words[-1]
    if end > last.start and end + 0.5 < last.end:
        last.end = max(last.start + median, end)
    else:
        end = last.end
    return start, end
