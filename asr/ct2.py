"""Reads a CTranslate2 / faster-whisper Whisper `model.bin` into a transformers
`WhisperForConditionalGeneration` (layout in shared/DESIGN.md)."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


class CT2FormatError(ValueError):
    pass


def read_variables(data: bytes | memoryview, source: str) -> dict[str, np.ndarray]:
    """Parses model.bin (format version 6) into named arrays, aliases resolved."""
    view = memoryview(data)
    offset = 0

    def take(fmt: str):
        nonlocal offset
        try:
            values = struct.unpack_from(fmt, view, offset)
        except struct.error as error:
            raise CT2FormatError(f"{source}: truncated CTranslate2 model file") from error
        offset += struct.calcsize(fmt)
        return values[0]

    def string() -> str:
        nonlocal offset
        n = take("<H")
        try:
            text = bytes(view[offset : offset + n]).rstrip(b"\0").decode()
        except UnicodeDecodeError as error:
            raise CT2FormatError(f"{source}: damaged CTranslate2 model file (a name at byte {offset} is not text)") from error
        offset += n
        return text

    if bytes(view[:24]) == b"version https://git-lfs.":  # a clone without git-lfs: a text file naming the weights
        raise CT2FormatError(f"{source}: a Git LFS pointer, not the weights: `git lfs pull` in its repository fetches them")
    version = take("<I")
    if version == 0:  # what a preallocated file holds where the download or copy stopped
        raise CT2FormatError(f"{source}: damaged CTranslate2 model file (it begins with zeros: an interrupted download "
                             "or copy?)")
    if version > 255:  # formats have counted from 1 upwards: these are the bytes of some other file
        raise CT2FormatError(f"{source}: not a CTranslate2 model file (it begins with {bytes(view[:8])!r})")
    if version != 6:
        raise CT2FormatError(f"{source}: CTranslate2 model format version {version} is not supported (expected 6)")
    spec = string()
    if spec != "WhisperSpec":
        raise CT2FormatError(f"{source}: holds a {spec!r}, not a Whisper model")
    take("<I")  # spec revision
    variables: dict[str, np.ndarray] = {}
    for _ in range(take("<I")):
        name = string()
        dims = [take("<I") for _ in range(take("<B"))]
        dtype_code = take("<B")
        n_bytes = take("<I")
        if offset + n_bytes > len(view):
            raise CT2FormatError(f"{source}: truncated CTranslate2 model file at {name}")
        if dtype_code == 5:  # bfloat16: widen through the top half of float32
            raw = np.frombuffer(view[offset : offset + n_bytes], dtype=np.uint16).astype(np.uint32) << 16
            array = raw.view(np.float32)
        elif dtype_code in _DTYPES:
            array = np.frombuffer(view[offset : offset + n_bytes], dtype=_DTYPES[dtype_code])
        else:
            raise CT2FormatError(f"{source}: variable {name} has unknown dtype code {dtype_code}")
        if array.size != int(np.prod(dims)):
            raise CT2FormatError(f"{source}: variable {name} holds {array.size} values, not its shape {dims}'s")
        variables[name] = array.reshape(dims)
        offset += n_bytes
    for _ in range(take("<I")):
        alias, target = string(), string()
        if target not in variables:
            raise CT2FormatError(f"{source}: damaged CTranslate2 model file ({alias} names {target}, which it lacks)")
        variables[alias] = variables[target]
    if offset != len(view):  # two files joined, or a part joined twice
        raise CT2FormatError(f"{source}: damaged CTranslate2 model file ({len(view) - offset} bytes after its end)")
    return variables


def _floats(variables: dict[str, np.ndarray], name: str) -> np.ndarray:
    """A variable as float32, in memory of its own (not a view into the file's bytes, which
    it would keep whole); a weight de-quantised when stored as integers with a scale (int8:
    one per row, int16: one for the matrix; the stored value is the weight times its scale)."""
    array = variables[name]
    if np.issubdtype(array.dtype, np.integer):
        scale = variables[name.replace("/weight", "/weight_scale")].astype(np.float32)
        rows = scale.reshape(-1, *([1] * (array.ndim - 1))) if scale.size > 1 else scale.reshape(())
        return array.astype(np.float32) / rows
    return array.astype(np.float32)


def _count_layers(variables: dict[str, np.ndarray], stack: str) -> int:
    indices = {int(m.group(1)) for name in variables if (m := re.match(rf"{stack}/layer_(\d+)/", name))}
    return len(indices)


def to_transformers(variables: dict[str, np.ndarray], dtype: torch.dtype) -> WhisperForConditionalGeneration:
    """Builds the transformers model, its dimensions read off the tensors."""
    v = variables
    d_model, n_mels, _ = v["encoder/conv1/weight"].shape
    # CTranslate2 stores the output head as an alias of the token embedding where they are
    # equal (Whisper's); a fine-tune's own head is a tensor of its own, which CTranslate2 uses.
    head = v.get("decoder/projection/weight")
    untied = head is not None and head is not v["decoder/embeddings/weight"]
    config = WhisperConfig(
        vocab_size=v["decoder/embeddings/weight"].shape[0],
        num_mel_bins=int(n_mels),
        d_model=int(d_model),
        encoder_layers=_count_layers(v, "encoder"),
        decoder_layers=_count_layers(v, "decoder"),
        encoder_attention_heads=int(v["encoder/num_heads"]),
        decoder_attention_heads=int(v["decoder/num_heads"]),
        encoder_ffn_dim=v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=v["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=v["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=v["decoder/position_encodings/encodings"].shape[0],
        tie_word_embeddings=not untied,
    )
    state: dict[str, np.ndarray] = {}

    def norm(src: str, dst: str) -> None:
        state[f"{dst}.weight"] = _floats(v, f"{src}/gamma")
        state[f"{dst}.bias"] = _floats(v, f"{src}/beta")

    def linear(src: str, dst: str) -> None:
        state[f"{dst}.weight"] = _floats(v, f"{src}/weight")
        state[f"{dst}.bias"] = _floats(v, f"{src}/bias")

    def split(src: str, dsts: list[str]) -> None:
        """Fused projections: rows of q/k/v (or k/v) stacked; k has no bias."""
        weights = np.split(_floats(v, f"{src}/weight"), len(dsts))
        biases = np.split(_floats(v, f"{src}/bias"), len(dsts))
        for dst, weight, bias in zip(dsts, weights, biases):
            state[f"{dst}.weight"] = weight
            if not dst.endswith("k_proj"):
                state[f"{dst}.bias"] = bias

    for conv in ("conv1", "conv2"):
        linear(f"encoder/{conv}", f"model.encoder.{conv}")
    state["model.encoder.embed_positions.weight"] = _floats(v, "encoder/position_encodings/encodings")
    state["model.decoder.embed_positions.weight"] = _floats(v, "decoder/position_encodings/encodings")
    state["model.decoder.embed_tokens.weight"] = _floats(v, "decoder/embeddings/weight")
    if untied:
        state["proj_out.weight"] = _floats(v, "decoder/projection/weight")
    for stack in ("encoder", "decoder"):
        norm(f"{stack}/layer_norm", f"model.{stack}.layer_norm")
        for i in range(getattr(config, f"{stack}_layers")):
            src, dst = f"{stack}/layer_{i}", f"model.{stack}.layers.{i}"
            norm(f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
            split(f"{src}/self_attention/linear_0", [f"{dst}.self_attn.{p}_proj" for p in "qkv"])
            linear(f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj")
            norm(f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")
            linear(f"{src}/ffn/linear_0", f"{dst}.fc1")
            linear(f"{src}/ffn/linear_1", f"{dst}.fc2")
            if stack == "decoder":
                norm(f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
                linear(f"{src}/attention/linear_0", f"{dst}.encoder_attn.q_proj")
                split(f"{src}/attention/linear_1", [f"{dst}.encoder_attn.{p}_proj" for p in "kv"])
                linear(f"{src}/attention/linear_2", f"{dst}.encoder_attn.out_proj")

    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    tensors = {name: torch.from_numpy(a).to(dtype) for name, a in state.items()}  # _floats' own copies, not copied again
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    missing = [m for m in missing if m != "proj_out.weight"]
    if missing or unexpected:
        raise CT2FormatError(f"CTranslate2 conversion left weights unmatched: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def _joined(parts: list[Path]) -> bytearray:
    """The parts' bytes read into one buffer (b"".join of the parts read held both at once)."""
    data = bytearray(sum(part.stat().st_size for part in parts))
    offset = 0
    for part in parts:
        with open(part, "rb") as file:
            while read := file.readinto(memoryview(data)[offset:]):
                offset += read
    if offset != len(data):  # a part changed as it was read
        raise CT2FormatError(f"{parts[0]}: its parts changed while they were read ({offset} of {len(data)} bytes)")
    return data


def load_ct2_directory(directory: Path, dtype: torch.dtype, model_parts: list[Path] | None = None) -> WhisperForConditionalGeneration:
    """model_parts: files whose concatenation is model.bin (packages split it in two)."""
    parts = model_parts or [directory / "model.bin"]
    for part in parts:
        if not part.is_file():
            pieces = sorted(p.name for p in part.parent.glob(f"{part.name}.part*"))
            held = f" (this one holds {', '.join(pieces)}: pieces of it, to be joined in order)" if pieces else ""
            raise FileNotFoundError(f"{part}: missing; a CTranslate2 Whisper directory holds model.bin, config.json, "
                                    f"tokenizer.json{held}")
    data = parts[0].read_bytes() if len(parts) == 1 else _joined(parts)
    # Damage in a later part was told as the first's.
    source = str(parts[0]) if len(parts) == 1 else f"{' + '.join(map(str, parts))} (joined)"
    try:
        return to_transformers(read_variables(data, source), dtype)
    except CT2FormatError:
        raise
    except (KeyError, RuntimeError, ValueError) as error:  # a tensor's name, size or shape is not what Whisper's are
        raise CT2FormatError(f"{source}: damaged CTranslate2 model file, or not a Whisper model's "
                             f"({type(error).__name__}: {error})") from error
