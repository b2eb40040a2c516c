"""Whisper's special tokens and text decoding, read from a tokenizer by name (ids shift
between vocabularies: English-only models and large-v3 differ from base)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

TIMESTAMPS = 1501  # <|0.00|> to <|30.00|>, the last rows of every Whisper vocabulary


def language_code(language: str) -> str:
    """A language as Whisper's own command line takes it: its code in any case ("EN"), or its
    name ("English", "castilian"); "English" was refused as unknown. A region or script
    after the code ("en-US", "pt_BR", "zh-Hans", as spreadsheets and locales write them) is
    dropped: Whisper's languages have none."""
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    language = language.strip().lower()
    if tagged := re.fullmatch(r"([a-z]{2,3})(?:[-_][a-z0-9]{2,8})+", language):  # zh-Hant-TW too
        language = tagged.group(1)
    return TO_LANGUAGE_CODE.get(language, language)


@dataclass(frozen=True)
class Vocabulary:
    tokenizer: Tokenizer
    size: int  # rows of the model's embedding, timestamps included
    eot: int
    sot: int
    sot_prev: int
    sot_lm: int
    no_speech: int
    no_timestamps: int
    transcribe: int
    translate: int
    languages: dict[str, int] = field(default_factory=dict)  # "en" -> <|en|>

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @property
    def multilingual(self) -> bool:
        return self.size >= 51865  # Whisper's own test: English-only vocabularies are smaller

    def sot_sequence(self, language: str | None, task: str) -> list[int]:
        """<|startoftranscript|> [<|lang|> <|task|>]; English-only models take no more."""
        if not self.multilingual:
            return [self.sot]
        if language not in self.languages:
            raise ValueError(f"unknown language {language!r}; choose one of {', '.join(self.languages)}")
        return [self.sot, self.languages[language], self.translate if task == "translate" else self.transcribe]

    def non_speech_specials(self) -> list[int]:
        """Control tokens a transcript must never contain (as openai/whisper suppresses)."""
        return [self.transcribe, self.translate, self.sot, self.sot_prev, self.sot_lm, self.no_speech]

    def non_speech_tokens(self) -> list[int]:
        """Symbols speech is not written with (brackets, slashes, music notes, ...): Whisper's
        own list, computed from the tokenizer as openai/whisper and faster-whisper do, for
        models whose files name no suppressed tokens. A symbol counts where it is one token,
        alone or after a space; a music note always, by its first token."""
        symbols = [*'"#()*+/:;<=>@[\\]^_`{|}~「」『』',
                   *"<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()]
        notes = "♩♪♫♬♭♮♯"
        found = {self.encode(" -")[0], self.encode(" '")[0]}
        for symbol in [*symbols, *notes]:
            for tokens in (self.encode(symbol), self.encode(" " + symbol)):
                if len(tokens) == 1 or symbol in notes:
                    found.add(tokens[0])
        return sorted(found)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t < self.eot])

    @classmethod
    def from_tokenizer_file(cls, path: str | Path, size: int) -> "Vocabulary":
        path = Path(path)
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:
            raise ValueError(f"{path}: not a readable tokenizer.json ({error})") from error
        # A prompt's "<|endoftext|>" or "<|en|>" is text: as a control token it ends or
        # redirects the prompt the model reads (openai/whisper refuses such text).
        tokenizer.encode_special_tokens = True
        added = {token.content: i for i, token in tokenizer.get_added_tokens_decoder().items()}

        def token(*names: str) -> int:
            for name in names:
                if name in added:
                    return added[name]
            raise ValueError(f"{path}: tokenizer has none of {names}; is this a Whisper tokenizer?")

        no_timestamps = token("<|notimestamps|>")
        # Whisper's ids shift between vocabularies, and its 1,501 timestamps end the model's
        # rows: another model's tokenizer (English-only for multilingual, or the reverse)
        # would start every window with the wrong tokens and decode nonsense.
        if no_timestamps + 1 + TIMESTAMPS != size:
            raise ValueError(f"{path}: a tokenizer for a model of {no_timestamps + 1 + TIMESTAMPS} tokens, not this "
                             f"model's {size}: the tokenizer.json of another model")
        translate = token("<|translate|>")
        sot = token("<|startoftranscript|>")
        languages = {
            name[2:-2]: i for name, i in added.items() if sot < i < translate and name.startswith("<|")
        }
        return cls(
            tokenizer=tokenizer,
            size=size,
            eot=token("<|endoftext|>"),
            sot=sot,
            sot_prev=token("<|startofprev|>"),
            sot_lm=token("<|startoflm|>"),
            no_speech=token("<|nospeech|>", "<|nocaptions|>"),
            no_timestamps=no_timestamps,
            transcribe=token("<|transcribe|>"),
            translate=translate,
            languages=languages,
        )
