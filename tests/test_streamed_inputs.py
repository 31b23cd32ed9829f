"""Streamed layer inputs (``patch_llama(..., offload="cpu", offload_stream=True)``,
``ckpt_ext.offload.Offloader(stream=True)``): a ``min_memory`` layer's input stays in host memory
through its backward, which copies it to the device a token chunk at a time.

On the CPU the host and the device are one, so the C++ backward's streamed path is run with
``ckpt_ext._C.set_streamed_input_check(True)``: every layer backward then reads its input as
a streamed one (each chunk copied), with a NaN in place of the input itself, so a read that
bypasses the chunk copies would show in the results. The op gives the unstreamed results bit
for bit (every preset, part, mask and head layout of tests/test_chunked_layer.py, in one chunk
and in chunks of 17 tokens); HF models with segments give k = 1's gradients without offload bit
for bit; the device pool holds no slot for a streamed call; rebuilt inputs sit in the host
pool until their layer's backward; bad arguments are refused."""
import copy
import os

import pytest
import torch

import ckpt_ext
from ckpt_ext import _C, config
from ckpt_ext.offload import Offloader

import test_chunked_layer as chunked

transformers = pytest.importorskip("transformers", reason="the HF cases need transformers")

from test_segments import assert_bitwise, batch_of, model_of, step  # noqa: E402


@pytest.fixture
def streamed_check():
    _C.set_streamed_input_check(True)
    yield
    _C.set_streamed_input_check(False)


@pytest.fixture
def restore_chunks():
    yield
    config.update(chunk_bytes=config.KernelConfig.chunk_bytes)


def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return seed


def _copies(fn):
    """fn's result and the number of aten::_to_copy calls it made."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")


def _equal(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2].keys() == b[2].keys() \
        and all(torch.equal(a[2][n], b[2][n]) for n in a[2])


OP_CASES = [(name, "min_memory") for name in chunked.CASES] + \
    [(name, preset) for name in ("qk_norm", "padded_eager") for preset in ("balanced", "fast")]


@pytest.mark.parametrize("name,preset", OP_CASES)
def test_op_reads_a_streamed_input_chunk_by_chunk(restore_chunks, preset, name):
    """fp64: the layer and its attention sublayer, in one chunk and in chunks of 17 tokens:
    the streamed backward's output and gradients equal the plain one's bit for bit."""
    x, weights, pe, dy, kw = chunked.case(name, torch.float64, seed=fresh_seed() % 1000)
    for part in ("layer", "attention"):
        for rows in (None, 17):
            config.update(chunk_bytes=config.KernelConfig.chunk_bytes if rows is None else
                          chunked.chunk_cap(rows, torch.float64, weights, part))
            plain = chunked.run(x, weights, pe, dy, kw, preset, part)
            _C.set_streamed_input_check(True)
            try:
                got = chunked.run(x, weights, pe, dy, kw, preset, part)
            finally:
                _C.set_streamed_input_check(False)
            assert _equal(got, plain), (part, rows)


@pytest.mark.parametrize("part,rows", [("layer", None), ("layer", 17), ("attention", 17)])
def test_the_streamed_path_copies_each_chunk(restore_chunks, part, rows):
    """The path is taken: the streamed backward copies at least one chunk per chunk it reads,
    and still gives the plain results."""
    x, weights, pe, dy, kw = chunked.case("padded", torch.float64, seed=fresh_seed() % 1000)
    config.update(chunk_bytes=config.KernelConfig.chunk_bytes if rows is None else
                  chunked.chunk_cap(rows, torch.float64, weights, part))
    plain, plain_copies = _copies(lambda: chunked.run(x, weights, pe, dy, kw, "min_memory", part))
    _C.set_streamed_input_check(True)
    try:
        got, copies = _copies(lambda: chunked.run(x, weights, pe, dy, kw, "min_memory", part))
    finally:
        _C.set_streamed_input_check(False)
    assert _equal(got, plain)
    chunks = 1 if rows is None else -(-x.shape[1] // rows) * x.shape[0]
    assert copies - plain_copies >= chunks, (copies, plain_copies)


def test_the_stand_in_would_show_a_read_of_the_input(streamed_check):
    """What makes the test above able to fail: under the check the op's x is a NaN stand-in;
    a backward given only the stand-in (no host copy to read) returns NaN."""
    x, weights, pe, dy, kw = chunked.case("lora_dropout", torch.float64)
    got = chunked.run(x, weights, pe, dy, kw, "min_memory", "layer")
    assert torch.isfinite(got[1]).all()
    _C.set_streamed_input_check(False)
    nan_x = torch.full_like(x, float("nan"))
    assert torch.isnan(chunked.run(nan_x, weights, pe, dy, kw, "min_memory", "layer")[1]).all()


def _plain_and_streamed(base, batch, seed, k):
    """(min_memory's step without offload, its step with streamed inputs in segments of k,
    the latter's offloader), each on a copy of ``base``."""
    ref = copy.deepcopy(base)
    ckpt_ext.patch_llama(ref, "min_memory")
    want = step(ref, batch, seed)
    model = copy.deepcopy(base)
    off = Offloader(stream=True)
    ckpt_ext.patch_llama(model, "min_memory", offload=off, segment_layers=k)
    return want, step(model, batch, seed), off


CASES_HF = [("llama", 1, "plain"), ("llama", 2, "padded"), ("llama", 3, "packed"),
            ("qwen3", 2, "plain"), ("qwen3_moe", 2, "plain")]


@pytest.mark.parametrize("family,k,kind", CASES_HF)
def test_hf_streamed_inputs_give_the_gradients_of_the_device(streamed_check, restore_chunks,
                                                             family, k, kind):
    """A tiny model with PEFT LoRA dropout (the MoE one without PEFT), min_memory, offload with streamed inputs, in
    segments of k (and chunks of a few tokens): the loss and every gradient equal those of
    min_memory without offload, k = 1, bit for bit; the offloader's device pool got no slot
    (an MoE layer's: its routing alone, less than one input) and its host pool is all given
    back after the step."""
    seed = fresh_seed()
    # PEFT refuses LoRA dropout on fused expert weights: the MoE model trains its own weights
    base = model_of(family, layers=4, seed=seed % 1000,
                    lora_dropout=None if family.endswith("_moe") else 0.1)
    batch = batch_of(kind, seed)
    if not family.endswith("_moe"):  # a few tokens a chunk (the MoE one's rows are wider)
        config.update(chunk_bytes=5 * 4 * 4 * 64)
    want, got, off = _plain_and_streamed(base, batch, seed, k)
    assert_bitwise(want, got)
    stats = off.stats()
    assert stats["host_in_use"] == 0 and stats["host_bytes"] > 0, stats  # pooled, given back
    if family.endswith("_moe"):   # the routing's float weights come back through the pool
        one = batch["input_ids"].numel() * base.config.hidden_size * 4
        assert 0 < stats["device_pool_bytes"] < one, stats
    else:
        assert stats["device_slots"] == 0, stats


def test_without_stream_the_pool_holds_the_inputs():
    """The comparison that makes the slot count above mean something: the same step without
    stream fetches each input into a device slot; balanced (residuals too) with stream also
    uses the pool: only min_memory calls stream."""
    seed = fresh_seed()
    batch = batch_of("plain", seed)
    for stream, preset in ((False, "min_memory"), (True, "balanced")):
        model = model_of("llama", layers=3, seed=seed % 1000)
        off = Offloader(stream=stream)
        ckpt_ext.patch_llama(model, preset, offload=off)
        step(model, batch, seed)
        assert off.stats()["device_slots"] > 0, (stream, preset)


def test_rebuilt_inputs_wait_in_the_host_pool(streamed_check):
    """k = 4: the rebuild puts layers 2..4's inputs in the host pool (three holds of one
    input's bytes each), which gives them back after their layers' backward."""
    seed = fresh_seed()
    model = model_of("llama", layers=4, seed=seed % 1000)
    off = Offloader(stream=True)
    ckpt_ext.patch_llama(model, "min_memory", offload=off, segment_layers=4)
    batch = batch_of("plain", seed)
    held, in_use = [], []
    hold = Offloader.hold

    def watched(self, t):
        got = hold(self, t)
        held.append((got[1] is not None, t.numel() * t.element_size()))
        in_use.append(self.stats()["host_in_use"])
        return got
    Offloader.hold = watched
    try:
        step(model, batch, seed)
    finally:
        Offloader.hold = hold
    ids = batch["input_ids"]
    one = ids.numel() * model.config.hidden_size * 4
    assert held == [(True, one)] * 3
    assert in_use == [2 * one, 3 * one, 4 * one]  # the segment's first input and the rebuilt
    assert off.stats()["host_in_use"] == 0


def test_a_limit_keeps_rebuilt_inputs_on_the_device(streamed_check):
    """offload_limit of one input: the segment's first input goes to host, the rebuilt ones
    stay on the device (the limit's rule); the gradients are unchanged."""
    seed = fresh_seed()
    base = model_of("llama", layers=4, seed=seed % 1000)
    batch = batch_of("plain", seed)
    ref = copy.deepcopy(base)
    ckpt_ext.patch_llama(ref, "min_memory")
    want = step(ref, batch, seed)
    one = batch["input_ids"].numel() * base.config.hidden_size * 4
    model = copy.deepcopy(base)
    off = Offloader(one, stream=True)
    ckpt_ext.patch_llama(model, "min_memory", offload=off, segment_layers=4)
    held = []
    hold = Offloader.hold
    Offloader.hold = lambda self, t: held.append(hold(self, t)[1] is None) or (t, None)
    try:
        assert_bitwise(want, step(model, batch, seed))
    finally:
        Offloader.hold = hold
    assert held == [True] * 3


@pytest.mark.parametrize("budget_inputs", [2, 4])
def test_auto_with_streamed_inputs_takes_the_plans_segments(streamed_check, budget_inputs):
    """policy="auto" with offload_stream: every layer min_memory, streamed, in segments of
    the plan's k for the budget (choose_segment_layers with stream); the step equals
    min_memory with that k given, bit for bit."""
    from ckpt_ext import plan
    from ckpt_ext.hf.patch import _decoder_layers
    from hf_fixtures import TINY
    seed = fresh_seed()
    base = model_of("llama", layers=4, seed=seed % 1000, lora_dropout=0.05)
    batch = batch_of("plain", seed)
    x = batch["input_ids"].numel() * TINY["hidden_size"] * 4
    model = copy.deepcopy(base)
    ckpt_ext.patch_llama(model, "auto", activation_budget=budget_inputs * x, offload="cpu",
                         offload_limit=x, offload_stream=True)
    got = step(model, batch, seed)
    shared = _decoder_layers(model)[1][0].forward.shared
    assert list(shared.auto.values()) == [["min_memory"] * 4]
    (k, _), = shared.auto_segments.values()
    want = plan.choose_segment_layers(shared.layer_dims(), TINY["vocab_size"], 2, 16,
                                      torch.float32, budget_inputs * x, x, offload=True,
                                      host_link_gbytes_per_s=shared.host_link, path="cpu",
                                      layers_only=True, stream=True,
                                      **ckpt_ext.throughputs.default_throughputs()
                                      .step_time_kwargs(16))
    assert k == want.segment_layers
    ref = copy.deepcopy(base)
    ckpt_ext.patch_llama(ref, "min_memory", offload="cpu", offload_limit=x,
                         offload_stream=True, segment_layers=k)
    assert_bitwise(step(ref, batch, seed), got)


def test_bad_arguments_are_refused():
    model = model_of("llama", layers=2)
    with pytest.raises(ValueError, match="offload_stream applies with offload='cpu'"):
        ckpt_ext.patch_llama(copy.deepcopy(model), "min_memory", offload_stream=True)
    with pytest.raises(ValueError, match="offload_stream: give stream=True to the Offloader"):
        ckpt_ext.patch_llama(copy.deepcopy(model), "min_memory", offload=Offloader(),
                             offload_stream=True)
    with pytest.raises(TypeError, match="offload_stream must be True or False"):
        ckpt_ext.patch_llama(copy.deepcopy(model), "min_memory", offload="cpu",
                             offload_stream=1)
    with pytest.raises(TypeError, match="offload stream must be True or False"):
        Offloader(stream="yes")
    copied = copy.deepcopy(Offloader(stream=True))
    assert copied.stream is True


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the input then lives in pinned host memory and "
                           "the backward copies its chunks across (the CPU runs the same code "
                           "on one device, above)")
def test_cuda_streamed_inputs_match_the_device_run(restore_chunks):
    """fp32 on CUDA: min_memory with streamed inputs (pinned host buffers, chunks copied on
    the compute stream) in segments of 2, chunks of a few tokens, against min_memory without
    offload: the same loss and gradients (to fp32 rounding: the default attention backward
    may sum in any order), no device slot, host buffers pinned."""
    seed = fresh_seed()
    base = model_of("llama", layers=4, seed=seed % 1000).cuda()
    batch = {k: v.cuda() for k, v in batch_of("padded", seed).items()}
    config.update(chunk_bytes=5 * 4 * 4 * 64)
    want, got, off = _plain_and_streamed(base, batch, seed, 2)
    torch.cuda.synchronize()
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert got[1].keys() == want[1].keys()
    for n in want[1]:
        torch.testing.assert_close(got[1][n], want[1][n], rtol=1e-4, atol=1e-6, msg=n)
    assert off.stats()["device_slots"] == 0
    assert off.host_buffers() and all(b.is_pinned() for b in off.host_buffers())
