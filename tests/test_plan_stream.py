"""The plan's streamed layer inputs under offload (``offload_step_peak(..., stream=True)``,
``python -m ckpt_ext.plan --offload --offload-stream``): a ``min_memory`` layer's offloaded
input stays in host memory through the backward, copied to the device a token chunk at a time,
so the prefetch pool is gone; in segments the rebuilt inputs go to host memory under the cap
and the rebuild is a device phase of its own. Hand-counted bytes on small odd shapes, the
refusals, the CLI flag and the LLaMA-3.1-8B figure the option is for."""
from __future__ import annotations

import pytest

from ckpt_ext import plan, plan_cli
from ckpt_ext.plan import LayerDims

GiB = 2**30
LLAMA31_8B = LayerDims(4096, 32, 8, 128, 14336)
V8B = 128256
CLI_8B = ["--hidden-size", "4096", "--heads", "32", "--kv-heads", "8", "--intermediate-size",
          "14336", "--layers", "32", "--vocab-size", "128256", "--batch", "1", "--dtype", "bf16"]
D1 = LayerDims(48, 3, 1, 16, 80)       # H 48, Q 48, K 16, I 80
D2 = LayerDims(40, 5, 1, 8, 72)
D3 = LayerDims(144, 9, 1, 16, 112)    # H > 2K by far: the rebuild's whole tensors pass the
V = 97                                # backward's; V small: the head's phase stays below


def _top_binds(layers, B, S, dt, **kw):
    """The step without offload peaks in its top layer's backward (the phase the streamed
    terms change), as the precondition of a hand count."""
    return plan.step_peak("min_memory", layers, V, B, S, dt, **kw).phase.startswith("top layer")


# ---- stream=False: the step as it was -------------------------------------------------------

# offload_step_peak's (peak, host, offloaded, kept, pool, rebuilt, calls) and cpu_step_peak,
# from the plan before streamed inputs existed (the commit before this file's)
_BEFORE = [
    (([D1] * 4, 1, 37, "fp32", "cpu", None, 1, True, 1 << 14),
     (255804, 28416, 4, 0, 14208, 0, 4), 241596),
    (([D1] * 5, 2, 53, "bf16", "cuda", None, 2, False, None),
     (67174584, 30528, 3, 0, 20352, 10176, 3), 469368),
    (([D1] * 5, 1, 40009, "fp32", "cuda", 3 * 40009 * 48 * 4, 2, False, None),
     (185909356, 23045184, 3, 0, 15363456, 7681728, 3), 173091120),
    (([D2] * 7, 3, 29, "fp32", "cpu", 2 * 3 * 29 * 40 * 4, 3, True, 1 << 13),
     (268340, 27840, 2, 13920, 27840, 13920, 3), 240500),
    (([D2] * 7, 1, 1001, "fp16", "cuda", 5 * 1001 * 40 * 2, 1, False, None),
     (67793548, 400400, 5, 160160, 160160, 0, 7), 4528524),
]


@pytest.mark.parametrize("case,want,cpu", _BEFORE)
def test_stream_false_unchanged(case, want, cpu):
    layers, B, S, dt, path, cap, k, train, cb = case
    kw = dict(host_limit=cap, segment_layers=k, train_weights=train, chunk_bytes=cb)
    for extra in ({}, {"stream": False}):
        p = plan.offload_step_peak("min_memory", layers, 1000, B, S, dt, path=path, **kw,
                                   **extra)
        assert (p.peak, p.host, p.offloaded, p.kept, p.pool, p.rebuilt, p.calls) == want
        assert (p.stream, p.host_peak, p.host_rebuilt, p.rebuild, p.copies) == \
            (False, p.host, 0, 0, 0)
        assert plan.cpu_step_peak("min_memory", layers, 1000, B, S, dt, offload=True, **kw,
                                  **extra) == cpu


def test_stream_false_searches_unchanged():
    """The 8B longest-S figures of docs/offload.md's table (bench/results/plan_segments.txt)
    and a choice of k, as before."""
    L = [LLAMA31_8B] * 32
    hr = plan.headroom_bytes(80 * GiB)
    for host, want in ((128 * GiB, (1048576, 2)), (256 * GiB, (1174557, 2))):
        for extra in ({}, {"stream": False}):
            assert plan.longest_sequence_segments(L, V8B, 1, "bf16", 80 * GiB, "lora",
                                                  offload=True, host_memory=host,
                                                  headroom=hr, **extra) == want
    c = plan.choose_segment_layers(L, V8B, 1, 700000, "bf16", 55 * GiB, 256 * GiB,
                                   train_weights=False, lora_rank=16, stream=False)
    assert (c.segment_layers, c.peak, c.host, c.kept) == (1, 32552435712, 183500800000, 0)
    assert c.seconds == pytest.approx(2695.762187926587, rel=1e-12)


# ---- stream=True: the pool goes, the rebuilt inputs go to host memory -----------------------

def _x(d, B, S, e):
    """A layer input's bytes."""
    return B * S * d.hidden_size * e


@pytest.mark.parametrize("B,S,dt,e", [(1, 37, "fp32", 4), (2, 53, "bf16", 2),
                                      (3, 29, "fp16", 2)])
def test_stream_one_chunk_no_pool(B, S, dt, e):
    """k = 1, one chunk (the cap's rows pass T): the streamed step is the offloaded one less
    its pool of two inputs, plus the one chunk of the input (here all of it)."""
    layers = [D1] * 5
    T = B * S
    assert plan.layer_chunk_rows(D1, e, 1 << 26, 0) >= T
    kw = dict(path="cpu", train_weights=False, chunk_bytes=1 << 26)
    assert _top_binds(layers, B, S, dt, **kw)
    plain = plan.offload_step_peak("min_memory", layers, V, B, S, dt, **kw)
    p = plan.offload_step_peak("min_memory", layers, V, B, S, dt, stream=True, **kw)
    x = _x(D1, B, S, e)
    assert plain.pool == 2 * x
    assert (p.pool, p.host, p.host_peak, p.offloaded, p.kept, p.rebuilt, p.rebuild) == \
        (0, 5 * x, 5 * x, 5, 0, 0, 0)
    assert p.peak == plain.peak - 2 * x + x
    assert p.copies == 2 * 5 * x == plan.stream_copy_bytes(layers, B, S, dt)


def test_stream_chunks_no_pool():
    """Several chunks (CPU path, a small cap): the pool is replaced by one chunk of rows x H."""
    layers, B, S, e = [D2] * 4, 1, 301, 4
    cb = 1 << 13
    rows = plan.layer_chunk_rows(D2, e, cb, 0)
    assert rows < S
    kw = dict(path="cpu", train_weights=False, chunk_bytes=cb)
    assert _top_binds(layers, B, S, "fp32", **kw)
    plain = plan.offload_step_peak("min_memory", layers, V, B, S, "fp32", **kw)
    p = plan.offload_step_peak("min_memory", layers, V, B, S, "fp32", stream=True, **kw)
    assert p.pool == 0 and plain.pool == 2 * _x(D2, B, S, e)
    assert p.peak == plain.peak - plain.pool + rows * 40 * e
    # on the CPU the pools are allocated in the first step: the pool term is all that differs
    assert plan.cpu_step_peak("min_memory", layers, V, B, S, "fp32", offload=True,
                              stream=True, train_weights=False, chunk_bytes=cb) == p.peak


def test_stream_segments_rebuilt_to_host():
    """k = 2 on 4 layers, no cap: the host holds the two first inputs when the forward ends and
    one rebuilt input more at a segment's backward; nothing rebuilt stays on the device. Copies
    a segment: the first input read twice by its backward and once by the rebuild (3x), the
    rebuilt one written out and read twice (3x)."""
    layers, B, S, e = [D1] * 4, 1, 37, 4
    x = _x(D1, B, S, e)
    plain = plan.offload_step_peak("min_memory", layers, 1000, B, S, "fp32", path="cuda",
                                   segment_layers=2)
    p = plan.offload_step_peak("min_memory", layers, 1000, B, S, "fp32", path="cuda",
                               segment_layers=2, stream=True)
    assert (plain.host, plain.pool, plain.rebuilt) == (2 * x, 2 * x, x)
    assert (p.host, p.pool, p.rebuilt, p.host_peak, p.host_rebuilt, p.kept) == \
        (2 * x, 0, 0, 3 * x, x, 0)
    assert (p.offloaded, p.calls, p.stream) == (2, 2, True)
    assert p.copies == 12 * x == plan.stream_copy_bytes(layers, B, S, "fp32", 2)
    # k = 3 on 4 layers: a segment of 3 (3x + 2 rebuilt x 3x) and one of 1 (2x)
    assert plan.stream_copy_bytes(layers, B, S, "fp32", 3) == 11 * x


def test_stream_segments_cap():
    """A host cap of two inputs, k = 2 on 4 layers: both first inputs fit in forward; the top
    segment's rebuilt input does not (it stays on the device beside that segment's top layer
    backward), the lower segment's does once the top one has released its input."""
    layers, B, S, e = [D1] * 4, 1, 37, 4
    x = _x(D1, B, S, e)
    kw = dict(path="cpu", segment_layers=2, train_weights=False)
    assert _top_binds(layers, B, S, "fp32", **kw)
    p = plan.offload_step_peak("min_memory", layers, V, B, S, "fp32", stream=True,
                               host_limit=2 * x, **kw)
    assert (p.host, p.kept, p.rebuilt, p.host_peak, p.host_rebuilt) == (2 * x, 0, x, 2 * x, x)
    assert p.copies == (2 + 1) * x + (2 + 1 + 3) * x
    free = plan.offload_step_peak("min_memory", layers, V, B, S, "fp32", stream=True, **kw)
    assert free.rebuilt == 0 and p.rebuild == free.rebuild
    assert p.peak == free.peak + x       # the top layer's backward, one input more
    # a cap of one input: the second segment's input stays on the device from the forward
    q = plan.offload_step_peak("min_memory", layers, 1000, B, S, "fp32", stream=True,
                               path="cuda", segment_layers=2, host_limit=x)
    assert (q.host, q.kept, q.offloaded, q.host_peak) == (x, x, 1, x)


def test_stream_rebuild_phase_one_chunk():
    """The rebuild's device phase, counted by hand (one chunk, CUDA path, bf16): the top
    layer's dy, the replayed layer's input and output, its forward's work (normed x, q before
    and after RoPE, k before and after RoPE, v, out, h, the MLP input and output rows, three
    (T, I) SwiGLU tensors and the fp32 lse) and the cos/sin tables."""
    B, S, e = 2, 53, 2
    T = B * S
    H, Q, K, I, Hq, D = 48, 48, 16, 80, 3, 16
    assert plan.mlp_chunk_rows(D1, e, 1 << 26, "cuda") >= T
    p = plan.offload_step_peak("min_memory", [D1] * 2, 1000, B, S, "bf16", path="cuda",
                               segment_layers=2, stream=True, train_weights=False)
    work = e * T * (4 * H + 3 * Q + 3 * K) + 4 * Hq * T + 3 * e * T * I
    assert p.rebuild == 3 * e * T * H + work + 2 * S * D * e
    assert p.peak >= p.rebuild


def test_stream_rebuild_phase_binds():
    """Several chunks in fp32 on the CPU path with H = 9K: the rebuild's whole tensors (dy,
    input, output: 3 e H a token, with k, v) pass the top layer's backward's (dy, dx: 2 e H,
    with k, v, the fp32 dk, dv sums 8 K and the CPU's fp32 key copies 16 K), so the rebuild
    is the step's peak. Counted by hand: k, v whole and the forward's work of one chunk of
    the engine's rows (its CPU SwiGLU buffers by the engine's rule)."""
    from ckpt_ext import _C
    B, S, e, cb = 1, 4001, 4, 1 << 14
    T = B * S
    H, Q, K, I, Hq, D = 144, 144, 16, 112, 9, 16
    rows = plan.layer_chunk_rows(D3, e, cb, 0)
    mrows = min(rows, plan.mlp_chunk_rows(D3, e, cb, "cpu"))
    n = _C.swiglu_buffers(False, False)
    assert rows < S
    kw = dict(path="cpu", segment_layers=2, train_weights=False, chunk_bytes=cb)
    p = plan.offload_step_peak("min_memory", [D3] * 4, V, B, S, "fp32", stream=True, **kw)
    work = 2 * e * T * K + e * rows * (4 * H + 3 * Q + 3 * K) + 4 * Hq * rows \
        + n * 4 * I * min(mrows, _C.swiglu_chunk_rows(I, n, 4, cb))
    assert p.rebuild == 3 * e * T * H + work + 2 * S * D * e
    assert p.peak == p.rebuild
    # the top layer's backward, as without streaming less the pool and the rebuilt input,
    # plus one chunk of the input: below the rebuild
    assert _top_binds([D3] * 4, B, S, "fp32", **kw)
    plain = plan.offload_step_peak("min_memory", [D3] * 4, V, B, S, "fp32", **kw)
    top = plain.peak - plain.pool - plain.rebuilt + e * rows * H
    assert top < p.rebuild


def test_stream_seconds_add_serialized_copies():
    """choose_segment_layers' time with stream: the step's compute plus the copies at the link
    (the forward's copy to host memory hides under compute at these sizes)."""
    L = [LLAMA31_8B] * 32
    room = 80 * GiB - plan.headroom_bytes(80 * GiB) - plan.model_state_bytes(L, V8B, "bf16",
                                                                            "lora")
    c = plan.choose_segment_layers(L, V8B, 1, 2097152, "bf16", room, 256 * GiB,
                                   train_weights=False, lora_rank=16, stream=True,
                                   host_link_gbytes_per_s=12.5)
    compute = plan.step_time_estimate("min_memory", L, V8B, 1, 2097152, train_weights=False,
                                      lora_rank=16, segment_layers=c.segment_layers)
    copies = plan.stream_copy_bytes(L, 1, 2097152, "bf16", c.segment_layers, 256 * GiB)
    assert copies > 0
    assert c.seconds == pytest.approx(compute + copies / 12.5e9, rel=1e-9)
    p = plan.offload_step_peak("min_memory", L, V8B, 1, 2097152, "bf16", train_weights=False,
                               host_limit=256 * GiB, segment_layers=c.segment_layers,
                               stream=True)
    assert (c.peak, c.host) == (p.peak, p.host_peak)


# ---- refusals -----------------------------------------------------------------------------

@pytest.mark.parametrize("setup", ["fast", "balanced"])
def test_stream_other_presets_refused(setup):
    with pytest.raises(ValueError, match="stream"):
        plan.offload_step_peak(setup, [D1] * 3, 1000, 1, 37, "fp32", stream=True)
    with pytest.raises(ValueError, match="stream"):
        plan.longest_sequence_offload(setup, [D1] * 3, 1000, 1, "fp32", GiB, None, "lora",
                                      stream=True)
    with pytest.raises(ValueError, match="stream"):
        plan.cpu_step_peak(setup, [D1] * 3, 1000, 1, 37, "fp32", offload=True, stream=True)


def test_stream_refusals():
    with pytest.raises(ValueError, match="stream must be a bool"):
        plan.offload_step_peak("min_memory", [D1] * 3, 1000, 1, 37, "fp32", stream=1)
    with pytest.raises(ValueError, match="stream=True streams offloaded inputs"):
        plan.cpu_step_peak("min_memory", [D1] * 3, 1000, 1, 37, "fp32", stream=True)
    with pytest.raises(ValueError, match="stream=True streams offloaded inputs"):
        plan.choose_segment_layers([D1] * 3, 1000, 1, 37, "fp32", GiB, offload=False,
                                   stream=True)
    with pytest.raises(ValueError, match="stream=True streams offloaded inputs"):
        plan.longest_sequence_segments([D1] * 3, 1000, 1, "fp32", GiB, "lora", offload=False,
                                       stream=True)
    with pytest.raises(ValueError, match="stream=True streams offloaded inputs"):
        plan.longest_sequence_segments([D1] * 4, 1000, 1, "fp32", GiB, "lora",
                                       sequence_parallel=2, stream=True)


# ---- the CLI ------------------------------------------------------------------------------

def test_cli_offload_stream_needs_offload(capsys):
    with pytest.raises(SystemExit) as err:
        plan_cli.main(CLI_8B + ["--seq", "4096", "--offload-stream"])
    assert err.value.code == 2
    assert "--offload-stream: applies only with --offload" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        plan_cli.main(CLI_8B + ["--seq", "4096", "--offload", "--host-memory", "64GiB",
                                "--offload-stream", "--sequence-parallel", "2"])
    assert err.value.code == 2
    assert "--offload-stream: applies only without --sequence-parallel" in \
        capsys.readouterr().err


def test_cli_offload_stream_rows(capsys):
    """The 8B at 2,097,152 tokens, 256 GiB of host memory: the streamed rows, the K chosen
    and the longest S, as the plan's functions give them."""
    rc = plan_cli.main(CLI_8B + ["--seq", "2097152", "--device-memory", "80GiB", "--weights",
                                 "lora", "--offload", "--host-memory", "256GiB",
                                 "--segment-layers", "auto", "--offload-stream"])
    out = capsys.readouterr().out
    assert rc == 0
    L = [LLAMA31_8B] * 32
    n, k = plan.longest_sequence_segments(L, V8B, 1, "bf16", 80 * GiB, "lora", offload=True,
                                          host_memory=256 * GiB,
                                          headroom=plan.headroom_bytes(80 * GiB), stream=True)
    p = plan.offload_step_peak("min_memory", L, V8B, 1, 2097152, "bf16", train_weights=False,
                               host_limit=256 * GiB, segment_layers=k, stream=True)
    name = f"min_memory in {k}-layer segments + offload, streamed inputs"
    rows = [line for line in out.splitlines() if line.startswith(name + " ")]
    assert len(rows) == 2                       # the offload table and the verdict
    assert plan.format_bytes(p.peak) in rows[0] and plan.format_bytes(p.host_peak) in rows[0]
    assert "fits" in rows[1] and f"{n:,}" in rows[1]
    assert any(line.startswith("min_memory + offload, streamed inputs") for line in
               out.splitlines())
    assert (f"min_memory + offload, streamed inputs: at S 2,097,152 K {k} " in out
            and f"the longest S over K = 1..32: {n:,} with K {k}" in out)
    # without the flag, no streamed row
    plan_cli.main(CLI_8B + ["--seq", "4096", "--offload", "--host-memory", "64GiB"])
    assert "streamed" not in capsys.readouterr().out


# ---- the figure the option is for -----------------------------------------------------------

def test_llama31_8b_two_million_tokens():
    """LLaMA-3.1-8B LoRA, B 1, bf16, 80 GiB (the plan's headroom), 256 GiB of host memory:
    streamed inputs in segments reach two million tokens, where the pool of whole inputs
    stopped min_memory in segments at 1,174,557; 128 GiB of host falls short."""
    L = [LLAMA31_8B] * 32
    hr = plan.headroom_bytes(80 * GiB)
    kw = dict(offload=True, headroom=hr, stream=True)
    n, k = plan.longest_sequence_segments(L, V8B, 1, "bf16", 80 * GiB, "lora",
                                          host_memory=256 * GiB, **kw)
    assert n >= 2_000_000 and k > 1
    assert (n, k) == (2162508, 3)
    n128, k128 = plan.longest_sequence_segments(L, V8B, 1, "bf16", 80 * GiB, "lora",
                                                host_memory=128 * GiB, **kw)
    assert (n128, k128) == (1688533, 5)
    # at 256 GiB the top layer's backward binds: dy, dx, k, v and the fp32 dk, dv sums,
    # 28 KiB a token, beside nothing kept or rebuilt on the device
    room = 80 * GiB - hr - plan.model_state_bytes(L, V8B, "bf16", "lora")
    p = plan.offload_step_peak("min_memory", L, V8B, 1, n + 1, "bf16", train_weights=False,
                               host_limit=256 * GiB, segment_layers=k, stream=True)
    assert p.peak > room and p.kept == p.rebuilt == 0 and p.rebuild < p.peak
    assert p.peak > 28 * 1024 * (n + 1)
