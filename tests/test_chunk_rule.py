"""The fused layer's chunk rows chosen for time where memory allows (issue 55 item 3).

* The op's ``chunk_rows`` option: explicit rows give the byte cap's chunks of the same rows
  bit for bit and the one-chunk results to fp64 rounding (the layer, the attention and the MLP
  sublayers, every preset); in fp32 they meet the accuracy rule against float64; the backward
  walks the forward's rows whatever the cap says by then; bad values raise naming it.
* The rule (``plan.choose_chunk_rows``): one chunk when the step fits, else the fastest
  fitting candidate (checked against a brute force, with attention rates per row count that
  make the fewest chunks not the fastest), the cap's rows when nothing fits; ``step_peak``
  reads the rows; bad arguments name themselves.
* Who decides: a pinned ``chunk_bytes`` (the environment, ``config.patch`` / ``update``)
  turns the rule off in ``choose_auto`` and at run time; ``patch_llama`` hands the op the
  rule's rows under ``auto`` and fixed presets when a budget is known, none otherwise.
* The plan CLI prints each preset's chunks per layer and their time.
"""
import dataclasses

import pytest
import torch

import ckpt_ext
from ckpt_ext import blocks, config, plan, plan_cli
from ckpt_ext.layer_record import LayerDims
from ckpt_ext.throughputs import Rate, default_throughputs

from reference import FACTOR_GRAD, FACTOR_OUT, check_vs_baseline
from test_chunked_layer import assert_same, case, chunk_cap


_PART_WEIGHTS = {"layer": ("",), "attention": ("self_attn.", "input_layernorm."),
                 "mlp": ("mlp.", "post_attention_layernorm.")}


def _rows_run(x, weights, pe, dy, kw, preset, part, rows=None):
    """(y, dx, {name: gradient}) of ``part`` with chunk_rows ``rows``, its weights trained."""
    x = x.clone().requires_grad_()
    w = {n: t.clone().requires_grad_() for n, t in weights.items()
         if n.startswith(_PART_WEIGHTS[part])}
    if part == "mlp":   # no attention: no RoPE, no masks
        kw = {k: v for k, v in kw.items() if k not in ("num_heads", "num_kv_heads")}
        y = blocks.decoder_layer(x, blocks.LayerOptions(weights=w, preset=preset, part=part,
                                                        chunk_rows=rows, **kw))
    else:
        y = blocks.decoder_layer(x, blocks.LayerOptions(weights=w, cos=pe[0], sin=pe[1],
                                                        preset=preset, part=part,
                                                        chunk_rows=rows, **kw))
    y.backward(dy)
    return y.detach(), x.grad, {n: t.grad for n, t in w.items() if t.grad is not None}


def _same_bits(got, want, what):
    (y, dx, g), (y1, dx1, g1) = got, want
    assert torch.equal(y, y1) and torch.equal(dx, dx1), what
    assert g.keys() == g1.keys(), what
    for n in g1:
        assert torch.equal(g[n], g1[n]), f"{n} {what}"


# ---- the op's chunk_rows ------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["fast", "balanced", "min_memory"])
@pytest.mark.parametrize("part", ["layer", "attention", "mlp"])
def test_chunk_rows_equal_one_chunk_fp64(preset, part):
    """fp64: chunk_rows 1, 17, 64, 129 (two sequences of 70: pieces of one, one a chunk, both)
    give the default cap's one-chunk results to 1e-12, LoRA dropout on every projection."""
    x, weights, pe, dy, kw = case("lora_dropout", torch.float64, seed=5)
    whole = _rows_run(x, weights, pe, dy, kw, preset, part)   # the default cap: one chunk
    assert whole[2], "no gradients: the part's weights were not given"
    for rows in (1, 17, 64, 129):
        got = _rows_run(x, weights, pe, dy, kw, preset, part, rows)
        assert_same(got, whole, 1e-11, 1e-12, f"{part} chunk_rows {rows}")


@pytest.mark.parametrize("preset", ["fast", "min_memory"])
def test_chunk_rows_meet_the_accuracy_rule_fp32(preset):
    """fp32 in chunks of 17 and 64 rows (pieces of a sequence, and one sequence a chunk):
    output, dx and every weight and adapter gradient within the accuracy rule of the
    default-chunk op's error against float64."""
    x, weights, pe, dy, kw = case("padded", torch.float32, seed=6)
    f64 = lambda t: t.double() if torch.is_tensor(t) and t.is_floating_point() else t  # noqa
    ref = _rows_run(f64(x), {n: f64(t) for n, t in weights.items()}, tuple(map(f64, pe)),
                    f64(dy), {k: f64(v) for k, v in kw.items()}, preset, "layer")
    base = _rows_run(x, weights, pe, dy, kw, preset, "layer")
    for rows in (17, 64):
        got = _rows_run(x, weights, pe, dy, kw, preset, "layer", rows)
        check_vs_baseline("y", got[0], base[0], ref[0], FACTOR_OUT)
        check_vs_baseline("dx", got[1], base[1], ref[1], FACTOR_GRAD)
        for n in ref[2]:
            check_vs_baseline(n, got[2][n], base[2][n], ref[2][n], FACTOR_GRAD)


def test_backward_walks_the_forwards_chunk_rows():
    """The autograd Function saves chunk_rows with the other options: a cap set between
    forward and backward (one of 18 layer rows, whose CPU SwiGLU pieces stay whole chunks of
    17) changes no bit of the gradients of chunk_rows 17, where chunks of 18 rows do change
    the fp32 gradients' bits (so the check can fail)."""
    x, weights, pe, dy, kw = case("lora_dropout", torch.float32, seed=7)
    inter = weights["mlp.gate_proj.weight"].shape[0]
    between = 17 * 6 * inter * 4          # the CPU SwiGLU backward's six (rows, I) fp32 buffers
    q = weights["self_attn.q_proj.weight"].shape[0]
    assert between // ((4 * q + 3 * inter) * 4) == 18

    def step(rows, cap_between=None):
        xx = x.clone().requires_grad_()
        w = {n: t.clone().requires_grad_() for n, t in weights.items()}
        y = blocks.decoder_layer(xx, blocks.LayerOptions(
            weights=w, cos=pe[0], sin=pe[1], preset="balanced", chunk_rows=rows, **kw))
        if cap_between is not None:
            config.update(chunk_bytes=cap_between)
        y.backward(dy)
        config.update(chunk_bytes="")
        return y.detach(), xx.grad, {n: t.grad for n, t in w.items()}

    plain = step(17)
    _same_bits(step(17, cap_between=between), plain, "a cap set between forward and backward")
    other = step(18)
    assert any(not torch.equal(other[2][n], plain[2][n]) for n in plain[2])


def test_chunk_rows_set_the_backwards_memory():
    """min_memory's layer over 2 x 256 tokens: chunk_rows 32 holds the attention's and the
    MLP's per-token work one chunk at a time, so the step's peak falls below one chunk's; and
    under a cap of 32 rows chunk_rows of the whole batch peaks above the cap's own chunks of
    32 (the option, not the cap, sizes the layer's chunks; the CPU SwiGLU's pieces still
    follow the cap)."""
    x, weights, pe, dy, kw = case("lora_dropout", torch.float32, seed=8)
    x, dy = x.repeat(1, 4, 1)[:, :256], dy.repeat(1, 4, 1)[:, :256]
    from reference import rope_tables
    pe = rope_tables(256, x.shape[-1] // kw["num_heads"], dtype=torch.float32)

    def peak(rows):
        return ckpt_ext.peak_memory_bytes(
            lambda: _rows_run(x, weights, pe, dy, kw, "min_memory", "layer", rows))

    one = peak(2 * 256)
    small = peak(32)
    assert small < 0.8 * one, (small, one)
    config.update(chunk_bytes=chunk_cap(32, torch.float32, weights))
    capped, whole = peak(None), peak(2 * 256)
    print(f"one chunk {one}, chunk_rows 32 {small}; cap of 32 rows: {capped}, with chunk_rows "
          f"{2 * 256}: {whole}")
    assert whole > 1.2 * capped, (whole, capped)


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_chunk_rows_name_the_argument(bad):
    x, weights, pe, dy, kw = case("lora_dropout", torch.float32)
    with pytest.raises(ValueError, match=r"chunk_rows must be None \(the byte cap's rows\) or "
                                         rf"a positive number of token rows, got {bad}"):
        _rows_run(x, weights, pe, dy, kw, "fast", "layer", bad)


def test_chunk_rows_is_an_op_argument_with_none_by_default():
    assert "chunk_rows" in blocks.LAYER_ARGS
    assert blocks.LayerOptions(weights={}).chunk_rows is None


# ---- the rule --------------------------------------------------------------------------------
LLAMA8B = [LayerDims(4096, 32, 8, 128, 14336)] * 4
V8B = 128256


def _chunked_rates():
    """The plan's rates with attention backward rates per query-chunk row count: chunks of at
    most 8,192 rows fast, 8,193-20,000 slow, larger ones fast again: the fewest chunks that
    fit are then not always the fastest."""
    base = default_throughputs()
    chunked = (Rate("attention_backward", 400.0, rows_max=8192),
               Rate("attention_backward", 20.0, rows_min=8193, rows_max=20000))
    return dataclasses.replace(base, rates=chunked + base.rates)


def _brute(preset, layers, V, B_, S_, room, tp, **kw):
    """(rows, seconds) of every candidate whose step fits, by step_peak and layer_seconds."""
    cap = plan.layer_chunk_rows(layers[0], 2, config.current().chunk_bytes, plan.CUDA_SMS)
    out = []
    for rows in plan.chunk_row_candidates(B_, S_, cap):
        peak = plan.step_peak(preset, layers, V, B_, S_, "bf16", chunk_rows=rows, **kw).peak
        if peak > room:
            continue
        n = plan.engine_chunks(B_, S_, rows)
        secs = sum(plan.layer_seconds(preset, x, B_, S_, "bf16", chunks=n,
                                      overheads=tp.overheads,
                                      **tp.step_time_kwargs(S_, rows if n > 1 else None))
                   for x in layers)
        out.append((rows, secs, peak))
    return out


def test_rule_one_chunk_when_the_step_fits():
    c = plan.choose_chunk_rows("min_memory", LLAMA8B, V8B, 2, 16384, "bf16", room="200GiB")
    assert (c.rows, c.chunks, c.fits) == (2 * 16384, 1, True)
    assert c.peak == plan.step_peak("min_memory", LLAMA8B, V8B, 2, 16384, "bf16",
                                    chunk_rows=2 * 16384).peak
    assert c.seconds == pytest.approx(sum(c.layer_seconds)) and len(c.layer_seconds) == 4


@pytest.mark.parametrize("preset", ["fast", "balanced", "min_memory"])
@pytest.mark.parametrize("fraction", [0.45, 0.6, 0.8])
def test_rule_picks_the_fastest_fitting_count(preset, fraction):
    """Between the cap's peak and one chunk's: the rule's rows are the fastest of the
    candidates whose step fits (a brute force over step_peak and layer_seconds at the rates
    per row count), not merely the fewest chunks that fit; full fine-tune (the chunk sums
    cost time)."""
    tp = _chunked_rates()
    S_ = 65536
    one = plan.step_peak(preset, LLAMA8B, V8B, 1, S_, "bf16", chunk_rows=S_).peak
    least = plan.step_peak(preset, LLAMA8B, V8B, 1, S_, "bf16", chunk_rows=4096).peak
    room = int(least + fraction * (one - least))
    c = plan.choose_chunk_rows(preset, LLAMA8B, V8B, 1, S_, "bf16", room=room, throughputs=tp)
    fits = _brute(preset, LLAMA8B, V8B, 1, S_, room, tp)
    assert fits and c.fits and c.peak <= room
    best = min(fits, key=lambda f: (f[1], plan.engine_chunks(1, S_, f[0])))
    assert c.rows == best[0] and c.seconds == pytest.approx(best[1])
    assert c.chunks == plan.engine_chunks(1, S_, c.rows) > 1


def test_rule_fastest_is_not_the_fewest_chunks_under_row_rates():
    """With the slow 8,193-20,000-row chunk rate, at a room where 16,384-row chunks would be
    the fewest that fit, the rule goes to 8,192 rows (or one chunk when that fits)."""
    tp = _chunked_rates()
    S_ = 65536
    peaks = {r: plan.step_peak("min_memory", LLAMA8B, V8B, 1, S_, "bf16", chunk_rows=r).peak
             for r in (32768, 21846, 16384, 8192)}
    room = peaks[16384]
    assert peaks[21846] > room       # 16,384 rows are the fewest chunks that fit
    c = plan.choose_chunk_rows("min_memory", LLAMA8B, V8B, 1, S_, "bf16", room=room,
                               throughputs=tp)
    assert c.rows == 8192, c
    flat = plan.choose_chunk_rows("min_memory", LLAMA8B, V8B, 1, S_, "bf16", room=room)
    assert flat.rows == 16384, flat  # one rate for every row count: the fewest chunks


def test_rule_falls_back_to_the_cap_when_nothing_fits():
    c = plan.choose_chunk_rows("fast", LLAMA8B, V8B, 1, 65536, "bf16", room="1GiB")
    assert not c.fits and c.rows == c.cap_rows == 4096 and c.chunks == 16


def test_rule_on_the_cpu_path_and_with_a_mix():
    """path "cpu": the cap's rows are the engine's CPU rows (no CUDA minimum); ``saved``
    replaces the preset's own saved bytes in the peak (a mix of presets)."""
    L = [LayerDims(128, 4, 2, 32, 400)] * 2
    kw = dict(path="cpu", chunk_bytes=(4 * 128 + 3 * 400) * 4 * 150)
    assert plan.choose_chunk_rows("balanced", L, 512, 1, 1100, torch.float32, room="1GiB",
                                  **kw).rows == 1100
    c = plan.choose_chunk_rows("balanced", L, 512, 1, 1100, torch.float32, room=0, **kw)
    assert not c.fits and c.cap_rows == 150 and c.chunks == 8
    own = sum(plan.layer_bytes("balanced", x, 1, 1100, torch.float32) for x in L)
    mixed = plan.choose_chunk_rows("balanced", L, 512, 1, 1100, torch.float32, room="1GiB",
                                   saved=own + 1000, **kw)
    assert mixed.peak == plan.step_peak("balanced", L, 512, 1, 1100, torch.float32,
                                        chunk_rows=1100, **kw).peak + 1000


def test_candidates_and_engine_chunks():
    # pieces of one sequence, every count from 1 to the cap's
    assert plan.chunk_row_candidates(3, 1000, 282) == [3000, 2000, 1000, 500, 334, 282]
    assert [plan.engine_chunks(3, 1000, r) for r in (3000, 2000, 1000, 500, 334, 282)] == \
        [1, 2, 3, 6, 9, 12]
    # whole sequences packed, the fewest rows for each count (300 rows: 4 chunks, as the cap's
    # 350)
    assert plan.chunk_row_candidates(10, 100, 350) == [1000, 500, 400, 300]
    # counts past 64 go 25% apart, the cap's last
    many = plan.chunk_row_candidates(1, 1 << 20, 100)
    counts = [plan.engine_chunks(1, 1 << 20, r) for r in many]
    assert counts[:64] == list(range(1, 65)) and counts[-1] == -(-(1 << 20) // 100)
    assert len(many) < 120 and counts == sorted(set(counts))


def test_step_peak_reads_chunk_rows():
    """step_peak(chunk_rows=r) under a cap that gives r rows is step_peak at that cap (B 1;
    the cap still sizes the CPU SwiGLU's pieces), other rows change it, and more rows take
    more memory."""
    L = [LayerDims(128, 4, 2, 32, 400)] * 2
    width = (4 * 128 + 3 * 400) * 4
    for rows in (150, 300):
        kw = dict(path="cpu", chunk_bytes=width * rows)
        want = plan.step_peak("balanced", L, 512, 1, 1100, torch.float32, **kw)
        got = plan.step_peak("balanced", L, 512, 1, 1100, torch.float32, chunk_rows=rows, **kw)
        assert got.peak == want.peak, rows
        other = plan.step_peak("balanced", L, 512, 1, 1100, torch.float32,
                               chunk_rows=2 * rows, **kw)
        assert other.peak > want.peak, rows
    peaks = [plan.step_peak("min_memory", LLAMA8B * 8, V8B, 1, 65536, "bf16", chunk_rows=r,
                            train_weights=False).peak for r in (4096, 8192, 16384)]
    assert peaks == sorted(peaks) and len(set(peaks)) == 3


@pytest.mark.parametrize("call,match", [
    (lambda: plan.choose_chunk_rows("torch", LLAMA8B, V8B, 1, 8, "bf16", room=1), "preset"),
    (lambda: plan.choose_chunk_rows("fast", LLAMA8B, V8B, 1, 8, "bf16", room=-1), "room"),
    (lambda: plan.choose_chunk_rows("fast", LLAMA8B, V8B, 1, 8, "bf16", room="lots"), "room"),
    (lambda: plan.choose_chunk_rows("fast", LLAMA8B, V8B, 1, 8, "bf16", room=1, saved=-2),
     "saved"),
    (lambda: plan.choose_chunk_rows("fast", LLAMA8B, V8B, 1, 8, "bf16", room=1, path="tpu"),
     "path"),
    (lambda: plan.choose_chunk_rows("fast", [], V8B, 1, 8, "bf16", room=1), "layers"),
    (lambda: plan.step_peak("fast", LLAMA8B, V8B, 1, 8, "bf16", chunk_rows=0), "chunk_rows"),
    (lambda: plan.step_peak("fast", LLAMA8B, V8B, 1, 8, "bf16", chunk_rows=True),
     "chunk_rows"),
    (lambda: plan.layer_chunks(LLAMA8B[0], 1, 8, "bf16", chunk_rows=2.5), "chunk_rows"),
])
def test_rule_bad_arguments_name_themselves(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_choose_auto_is_exact_over_mixes_and_chunk_rows():
    """Two LLaMA-3-8B layers, full fine-tune, S 64K, at rooms from the smallest that fits up:
    choose_auto's time is the least of a brute force over every mix of AUTO_CHOICES and every
    candidate rows of each fused preset in it (one rows a preset), whose step fits; never
    slower with more room."""
    layers = LLAMA8B[:2]
    S_ = 65536
    tp = default_throughputs()
    cap = plan.layer_chunk_rows(layers[0], 2, config.current().chunk_bytes, plan.CUDA_SMS)
    cands = plan.chunk_row_candidates(1, S_, cap)
    saved = {p: plan._saved_bytes(p, layers[0], 1, S_, "bf16", True) for p in plan.AUTO_CHOICES}
    var = {}   # preset -> [(working set, seconds per layer)]

    def secs(p, n=1, r=None):
        return plan.layer_seconds(p, layers[0], 1, S_, "bf16", chunks=n, overheads=tp.overheads,
                                  **tp.step_time_kwargs(S_, r if n > 1 else None))

    for p in plan.AUTO_CHOICES:
        if p in ("none", "torch"):
            setup = "hf_gc+fused" if p == "torch" else p
            w = plan.step_peak(setup, layers, V8B, 1, S_, "bf16").peak - 2 * saved[p]
            var[p] = [(w, secs(p))]
            continue
        var[p] = []
        for r in cands:
            n = plan.engine_chunks(1, S_, r)
            w = plan.step_peak(p, layers, V8B, 1, S_, "bf16", chunk_rows=r).peak - 2 * saved[p]
            var[p].append((w, secs(p, n, r)))
    low = plan.step_peak("min_memory", layers, V8B, 1, S_, "bf16", chunk_rows=cap).peak
    high = plan.step_peak("fast", layers, V8B, 1, S_, "bf16", chunk_rows=S_).peak
    last = float("inf")
    for k in range(9):
        room = low + k * (high - low) // 8
        best = float("inf")
        for a in plan.AUTO_CHOICES:
            for b in plan.AUTO_CHOICES:
                for va in var[a]:
                    for vb in (var[b] if b != a else [va]):
                        if saved[a] + saved[b] + max(va[0], vb[0]) <= room:
                            best = min(best, va[1] + vb[1])
        got = plan.choose_auto(layers, V8B, 1, S_, "bf16", room=room)
        assert got.peak <= room
        assert got.seconds == pytest.approx(best, rel=1e-9), (room, got)
        assert got.seconds <= last * (1 + 1e-12)
        last = got.seconds


# ---- who decides: the pin ----------------------------------------------------------------------
def test_chunk_bytes_pinned_by_the_environment_patch_and_update(monkeypatch):
    monkeypatch.delenv("CKPT_EXT_CHUNK_BYTES", raising=False)
    config.reload()
    assert not config.chunk_bytes_pinned()
    with config.patch(chunk_bytes="16MiB"):
        assert config.chunk_bytes_pinned()
    assert not config.chunk_bytes_pinned()
    config.update(chunk_bytes=config.KernelConfig.chunk_bytes)   # the default value, given
    assert config.chunk_bytes_pinned()
    config.update(chunk_bytes="")
    assert not config.chunk_bytes_pinned()
    assert config.current().chunk_bytes == config.KernelConfig.chunk_bytes
    monkeypatch.setenv("CKPT_EXT_CHUNK_BYTES", "32MiB")
    config.reload()
    assert config.chunk_bytes_pinned() and config.current().chunk_bytes == 32 << 20
    with config.patch(chunk_bytes=""):
        assert not config.chunk_bytes_pinned()
    assert config.chunk_bytes_pinned()
    monkeypatch.setenv("CKPT_EXT_CHUNK_BYTES", "")   # an empty variable is unset
    config.reload()
    assert not config.chunk_bytes_pinned()
    monkeypatch.delenv("CKPT_EXT_CHUNK_BYTES")
    config.reload()


def test_a_pinned_cap_wins_in_choose_auto():
    """choose_auto at a room between the cap's and one chunk's peak: unpinned, its layers get
    the rule's rows (fewer chunks than the cap's); pinned (even at the default value), or
    given chunk_bytes, the cap's."""
    S_ = 65536
    room = plan.step_peak("min_memory", LLAMA8B, V8B, 1, S_, "bf16", chunk_rows=16384).peak
    kw = dict(room=room, train_weights=False, lora_rank=16)
    auto = plan.choose_auto(LLAMA8B, V8B, 1, S_, "bf16", **kw)
    fused = [i for i, p in enumerate(auto.presets) if p not in ("none", "torch")]
    assert fused and all(auto.rows[i] is not None and auto.chunks[i] < 16 for i in fused)
    assert auto.peak <= room
    with config.patch(chunk_bytes=config.KernelConfig.chunk_bytes):
        pinned = plan.choose_auto(LLAMA8B, V8B, 1, S_, "bf16", **kw)
    given = plan.choose_auto(LLAMA8B, V8B, 1, S_, "bf16", chunk_bytes=64 << 20, **kw)
    for c in (pinned, given):
        assert c.presets == auto.presets
        assert all(r is None for r in c.rows)
        assert [c.chunks[i] for i in fused] == [16] * len(fused)


# ---- who decides: at run time -------------------------------------------------------------------
def _tiny_model():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   vocab_size=300, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return model.train()


def _ops_rows(monkeypatch, model, ids):
    """The chunk_rows each fused layer call handed the op, and the loss."""
    from ckpt_ext.hf import patch as hf_patch
    seen = []
    real = hf_patch.decoder_layer

    def spy(x, options, *a, **k):
        seen.append(options.chunk_rows)
        return real(x, options, *a, **k)

    monkeypatch.setattr(hf_patch, "decoder_layer", spy)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return seen, loss.detach()


def test_auto_hands_the_op_the_rules_rows(monkeypatch):
    """policy="auto" on the CPU at the smallest activation_budget (every layer min_memory):
    the budget leaves the chunks no room (the cap's rows, None); with room for the step (on
    CUDA the device's; here through chunk_room) one chunk of B*S rows, the same loss as the
    unpatched model; pinned chunk_bytes: None again."""
    from ckpt_ext.hf import patch as hf_patch
    model = _tiny_model()
    ids = torch.randint(300, (2, 48), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids, labels=ids).loss.detach()
    dims = LayerDims(64, 4, 2, 16, 160)
    budget = 2 * plan.layer_bytes("min_memory", dims, 2, 48, torch.float32)
    ckpt_ext.patch_llama(model, "auto", activation_budget=budget)
    seen, loss = _ops_rows(monkeypatch, model, ids)
    (presets,) = model.model.layers[0].forward.shared.auto.values()
    assert presets == ["min_memory", "min_memory"]
    assert seen == [None, None]
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(hf_patch._Shared, "chunk_room", lambda self, *a, **k: 1 << 30)
    model.model.layers[0].forward.shared.rows.clear()   # cached per shape
    seen, loss = _ops_rows(monkeypatch, model, ids)
    assert seen == [96, 96]
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    config.update(chunk_bytes=config.KernelConfig.chunk_bytes)
    seen, _ = _ops_rows(monkeypatch, model, ids)
    assert seen == [None, None]


def test_fixed_presets_get_the_rule_where_a_budget_is_known(monkeypatch):
    """A fixed preset on the CPU has no budget (the cap); where one is known (on CUDA the
    device's room; here a room given through chunk_room), the rule's rows: one chunk at a
    large room, the cap's rows a chunk (pieces of each sequence) at a small one."""
    from ckpt_ext.hf import patch as hf_patch
    model = _tiny_model()
    ids = torch.randint(300, (2, 48), generator=torch.Generator().manual_seed(2))
    ckpt_ext.patch_llama(model, "balanced")
    seen, _ = _ops_rows(monkeypatch, model, ids)
    assert seen == [None, None]
    shared = model.model.layers[0].forward.shared
    monkeypatch.setattr(hf_patch._Shared, "chunk_room", lambda self, *a, **k: 1 << 30)
    shared.rows.clear()   # cached per shape
    seen, _ = _ops_rows(monkeypatch, model, ids)
    assert seen == [96, 96]
    shared.rows.clear()
    with torch.no_grad():    # the layers delegate: no rule (nothing computed, nothing cached)
        model(input_ids=ids)
    assert not shared.rows
    config.update(chunk_bytes=str((4 * 64 + 3 * 160) * 4 * 10))   # pinned: 10 rows a chunk
    seen, _ = _ops_rows(monkeypatch, model, ids)
    assert seen == [None, None]
    config.update(chunk_bytes="")
    monkeypatch.setattr(hf_patch._Shared, "chunk_room", lambda self, *a, **k: 0)
    shared.rows.clear()
    seen, _ = _ops_rows(monkeypatch, model, ids)   # nothing fits: no rows of the rule
    assert seen == [None, None]


# ---- the CLI -----------------------------------------------------------------------------------
def test_cli_prints_each_layers_chunks_and_time(tmp_path, capsys):
    """--device-memory: per fused preset, the rule's chunks and time per layer (the runs of
    equal layers), as choose_chunk_rows has them."""
    args = ["--hidden-size", "4096", "--intermediate-size", "14336", "--layers", "4",
            "--heads", "32", "--kv-heads", "8", "--vocab-size", str(V8B), "--batch", "1",
            "--seq", "65536", "--dtype", "bf16", "--weights", "lora",
            "--device-memory", "40GiB"]
    assert plan_cli.main(args) == 0
    out = capsys.readouterr().out
    lines = {ln.split(":")[0].strip(): ln for ln in out.splitlines()
             if ln.startswith("  ") and "rows" in ln}
    state = plan.model_state_bytes(LLAMA8B, V8B, "bf16", "lora")
    room = 40 * 2**30 - plan.headroom_bytes(40 * 2**30) - state
    for preset in ("fast", "balanced", "min_memory"):
        c = plan.choose_chunk_rows(preset, LLAMA8B, V8B, 1, 65536, "bf16", room=room,
                                   train_weights=False, lora_rank=plan.LORA_RANK)
        words = (f"layers 0-3: {c.chunks} chunk{'s' if c.chunks > 1 else ''} of "
                 f"{c.rows:,} rows, {c.layer_seconds[0] * 1e3:,.1f} ms each")
        assert words in lines[preset], (words, lines[preset])
    assert "chunk rows by time" in out


# ---- the memory model at the rule's rows ------------------------------------------------
@pytest.mark.parametrize("rows", [150, 300, 550, 1100])
@pytest.mark.parametrize("setup", ["fast", "balanced", "min_memory"])
def test_step_peak_at_chunk_rows_matches_the_cpu_allocator(rows, setup, monkeypatch):
    """plan.step_peak(chunk_rows=r) within 5% of the CPU allocator's peak of a training step
    whose fused layers get chunk_rows r under the default cap, as patch_llama hands the rule's
    rows (tests/test_plan.py's "layer-chunks" shapes, S 1100: 8, 4, 2 chunks and one)."""
    if torch.cuda.is_available():
        pytest.skip("measures the CPU allocator")
    from ckpt_ext.hf import patch as hf_patch
    import test_plan
    c = {k: v for k, v in test_plan.PEAK_CASES["layer-chunks"].items() if k != "cap"}
    monkeypatch.setitem(test_plan.PEAK_CASES, "rule-rows", c)
    monkeypatch.setattr(hf_patch._Shared, "chunk_rows",
                        lambda self, named, presets: {setup: rows})
    _, peak = test_plan._measured_peak("rule-rows", setup, monkeypatch)
    model = plan.step_peak(setup, [LayerDims(c["H"], c["heads"], c["kv"], c["D"], c["I"])] *
                           c["L"], c["V"], 1, c["S"], torch.float32, path="cpu",
                           chunk_rows=rows)
    print(f"{setup} chunk_rows {rows}: peak {peak} model {model.peak} ({model.phase})")
    assert abs(model.peak - peak) <= 0.05 * peak, (model.peak, peak, model.phase)


def test_rule_under_torch_compile_has_no_graph_breaks(monkeypatch):
    """The rule's rows reach the op in a compiled model too (a constant per shape): no graph
    break, the eager loss and gradients."""
    from ckpt_ext.hf import patch as hf_patch
    torch._dynamo.reset()
    model = _tiny_model()
    ids = torch.randint(300, (2, 48), generator=torch.Generator().manual_seed(3))
    ckpt_ext.patch_llama(model, "min_memory")
    monkeypatch.setattr(hf_patch._Shared, "chunk_room", lambda self, *a, **k: 1 << 30)
    seen, loss_e = _ops_rows(monkeypatch, model, ids)
    assert seen == [96, 96]
    grads_e = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    explain = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    loss_c = compiled(input_ids=ids, labels=ids).loss
    loss_c.backward()
    assert len(seen) > 2 and set(seen) == {96}    # the spy saw the traced calls' options
    torch.testing.assert_close(loss_c.detach(), loss_e, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads_e[n], rtol=1e-4, atol=1e-6)


def test_chunk_room_is_the_budget_or_the_devices_room(monkeypatch):
    """activation_budget (less QLoRA's transient); on CUDA the device's room, unless the
    parameters are sharded (ZeRO-3 / FSDP2: out of the room's count); else none."""
    from ckpt_ext.hf import patch as hf_patch
    model = ckpt_ext.patch_llama(_tiny_model(), "balanced")
    shared = model.model.layers[0].forward.shared
    monkeypatch.setattr(hf_patch._Shared, "device_room", lambda self, *a: 12345)
    assert shared.chunk_room("cpu", True) is None
    assert shared.chunk_room("cuda:0", True) == 12345
    p = next(model.parameters())
    p.ds_id = 0            # a ZeRO-3 partitioned parameter's mark
    assert shared.chunk_room("cuda:0", True) is None
    del p.ds_id
    shared.budget = 1000
    assert shared.chunk_room("cpu", True, dequantized=10) == 990
