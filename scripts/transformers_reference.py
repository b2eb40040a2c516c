"""transformers' greedy `generate` on our encoder output, with the same rules as ours: the
reference that scripts/benchmark.py and scripts/benchmark_gpu.py time our decoders against
(Whisper's generate wrapper would re-cut timestamped output into segments)."""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    WhisperTimeStampLogitsProcessor,
)
from transformers.generation.utils import GenerationMixin
from transformers.modeling_outputs import BaseModelOutput


def transformers_generate(model, encoded: torch.Tensor, prompt: list[int], suppress: list[int],
                          begin_suppress: list[int], no_timestamps: int | None, eot: int,
                          max_new: int) -> list[list[int]]:
    """Greedy tokens of each row of `encoded` after `prompt` (its first token the start of
    transcript), with timestamps where no_timestamps is given, cut at end-of-text."""
    device = encoded.device
    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=eot, pad_token_id=eot,
                              bos_token_id=eot, decoder_start_token_id=prompt[0], no_timestamps_token_id=no_timestamps,
                              max_initial_timestamp_index=50)
    processors = [SuppressTokensAtBeginLogitsProcessor(begin_suppress, begin_index=len(prompt), device=device),
                  SuppressTokensLogitsProcessor(suppress, device=device)]
    if no_timestamps is not None:
        processors.append(WhisperTimeStampLogitsProcessor(config, begin_index=len(prompt)))
    with torch.inference_mode():
        out = GenerationMixin.generate(model, encoder_outputs=BaseModelOutput(last_hidden_state=encoded),
                                       decoder_input_ids=torch.tensor([prompt] * len(encoded), device=device),
                                       logits_processor=LogitsProcessorList(processors), generation_config=config)
    rows = [row[len(prompt):].tolist() for row in out]
    return [row[: row.index(eot)] if eot in row else row for row in rows]
