"""ckpt_ext.config, the kernel settings: read from the environment once, checked values,
``patch()`` for a block, launchers that follow a change, and ``ops.attention``'s
``deterministic=``."""
import pytest
import torch

import ckpt_ext
from ckpt_ext import _backend, config, ops
from ckpt_ext.kernels import attention, swiglu_mlp

from reference import FACTOR_GRAD, attention_reference, check_vs_baseline, magnitude

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
interpreter_only = pytest.mark.skipif(CUDA, reason="the Triton interpreter on CPU tensors")

ALLOWED = {"CKPT_EXT_AUTOTUNE": "'0', '1'", "CKPT_EXT_ATTN_DQ":
           "'auto', 'separate', 'atomic', 'ordered'",
           "CKPT_EXT_SWIGLU_GRID": "'tiles', 'persistent'",
           "CKPT_EXT_SWIGLU_EPILOGUE": "'subtiled', 'whole'",
           "CKPT_EXT_BACKEND": "'auto', 'triton'",
           "CKPT_EXT_ATTN_BACKEND": "'auto', 'triton', 'flash', 'cudnn', 'efficient'"}
# Settings whose value is free text, checked otherwise (tests/test_attention_route.py,
# tests/test_attention_tuning.py; the chunk cap below).
FREE = {"CKPT_EXT_ATTN_TABLE", "CKPT_EXT_ATTN_BWD_CONFIGS", "CKPT_EXT_CHUNK_BYTES"}


# ---- reading the environment -----------------------------------------------------------------
def test_every_setting_has_a_variable_and_a_default():
    assert {s.env for s in config.SETTINGS.values()} == set(ALLOWED) | FREE
    defaults = config.from_environment({})
    assert defaults == config.KernelConfig()
    assert (defaults.autotune, defaults.attention_dq, defaults.swiglu_grid,
            defaults.swiglu_epilogue, defaults.backend, defaults.attention_backend,
            defaults.attention_table) == (True, "auto", "persistent", "subtiled", "auto",
                                          "auto", "")
    got = config.from_environment({"CKPT_EXT_AUTOTUNE": "0", "CKPT_EXT_ATTN_DQ": "atomic",
                                   "CKPT_EXT_SWIGLU_GRID": "tiles",
                                   "CKPT_EXT_SWIGLU_EPILOGUE": "whole",
                                   "CKPT_EXT_BACKEND": "triton",
                                   "CKPT_EXT_ATTN_BACKEND": "flash"})
    assert got == config.KernelConfig(False, "atomic", "tiles", "whole", "triton", "flash")


@pytest.mark.parametrize("env", sorted(ALLOWED))
@pytest.mark.parametrize("value", ["", "bogus", "1 "])
def test_bad_environment_values_name_the_variable(env, value):
    with pytest.raises(ValueError, match=f"^{env} must be one of {ALLOWED[env]}, got "
                                         f"{value!r}$"):
        config.from_environment({env: value})


def test_environment_is_read_once(monkeypatch):
    """The first use reads every variable; later uses (launches included) and later changes
    of the environment do not."""
    reads = []
    real = config.from_environment

    def counting(environ=None):
        reads.append(1)
        return real(environ)

    monkeypatch.setattr(config, "from_environment", counting)
    monkeypatch.setattr(config, "_current", None)
    monkeypatch.setenv("CKPT_EXT_ATTN_DQ", "atomic")
    assert config.current().attention_dq == "atomic"
    monkeypatch.setenv("CKPT_EXT_ATTN_DQ", "separate")
    monkeypatch.setenv("CKPT_EXT_SWIGLU_GRID", "tiles")
    for _ in range(3):
        assert attention.dq_mode() == "atomic"
        assert config.current().swiglu_grid == "persistent"
    if not CUDA:
        q = torch.randn(1, 2, 9, 16, dtype=torch.float32)
        out, lse = attention.attention_fwd(q, q, q, None, None, None, True, 0.25)
        attention.attention_bwd(out, q, q, q, out, lse, None, None, None, True, 0.25)
    assert len(reads) == 1
    assert config.reload().attention_dq == "separate" and len(reads) == 2


# ---- patch() ------------------------------------------------------------------------------------
def test_patch_changes_and_restores():
    before = config.current()
    with config.patch(attention_dq="atomic", swiglu_grid="tiles") as inside:
        assert inside is config.current()
        assert (inside.attention_dq, inside.swiglu_grid) == ("atomic", "tiles")
        assert inside.autotune == before.autotune
        with config.patch(attention_dq="separate"):
            assert config.current().attention_dq == "separate"
            assert config.current().swiglu_grid == "tiles"
        assert config.current().attention_dq == "atomic"
    assert config.current() == before


def test_patch_restores_on_exception():
    before = config.current()
    with pytest.raises(RuntimeError, match="inside"):
        with config.patch(swiglu_epilogue="whole"):
            assert config.current().swiglu_epilogue == "whole"
            raise RuntimeError("inside")
    assert config.current() == before


def test_patch_as_decorator():
    before = config.current()

    @config.patch(attention_dq="atomic")
    def f(x):
        return attention.dq_mode(), x

    assert f(3) == ("atomic", 3)
    assert config.current() == before
    assert f(4) == ("atomic", 4)   # usable more than once


@pytest.mark.parametrize("changes, match", [
    ({"attention_dq": "fast"},
     r"attention_dq \(CKPT_EXT_ATTN_DQ\) must be one of 'auto', 'separate', 'atomic', "
     r"'ordered', "
     r"got 'fast'"),
    ({"autotune": 1}, r"autotune \(CKPT_EXT_AUTOTUNE\) must be one of False, True, got 1"),
    ({"autotune": "0"}, r"autotune \(CKPT_EXT_AUTOTUNE\) must be one of False, True"),
    ({"swiglu_grid": None}, r"swiglu_grid \(CKPT_EXT_SWIGLU_GRID\) must be one of 'tiles'"),
    ({"backend": "cuda"}, r"backend \(CKPT_EXT_BACKEND\) must be one of 'auto', 'triton'"),
    ({"attention_backend": "sdpa"},
     r"attention_backend \(CKPT_EXT_ATTN_BACKEND\) must be one of 'auto', 'triton', 'flash'"),
    ({"attention_table": 3}, r"attention_table \(CKPT_EXT_ATTN_TABLE\) must be a str")])
def test_patch_rejects_bad_values(changes, match):
    before = config.current()
    with pytest.raises(ValueError, match=match):
        with config.patch(**changes):
            pytest.fail("the block must not run")
    assert config.current() == before


def test_patch_rejects_unknown_settings():
    with pytest.raises(TypeError, match="no setting named 'attn_dq'; the settings are "
                                        "autotune, attention_dq"):
        with config.patch(attn_dq="atomic"):
            pass


# ---- what follows a change ------------------------------------------------------------------------
def test_swiglu_launchers_follow_the_settings():
    """The cached launchers are rebuilt when a setting they were built from changes inside
    patch() and again after it."""
    dev = torch.device(DEVICE)

    def meta():
        return swiglu_mlp._fwd_launcher(dev, torch.float32, "ieee", False, False, False,
                                        None)[1]

    assert meta()["PERSISTENT"] is True
    with config.patch(swiglu_grid="tiles"):
        assert meta()["PERSISTENT"] is False
    assert meta()["PERSISTENT"] is True
    bwd_epi_n = swiglu_mlp._interpret_meta("bwd")["EPI_N"]
    with config.patch(swiglu_epilogue="whole"):
        assert swiglu_mlp._interpret_meta("bwd")["EPI_N"] == 64
    assert swiglu_mlp._interpret_meta("bwd")["EPI_N"] == bwd_epi_n


def test_autotune_change_rebuilds_launchers():
    dev = torch.device(DEVICE)
    first = swiglu_mlp._fwd_launcher(dev, torch.float32, "ieee", False, False, False, None)
    with config.patch(autotune=not config.current().autotune):
        inside = swiglu_mlp._fwd_launcher(dev, torch.float32, "ieee", False, False, False, None)
        assert inside is not first
    assert swiglu_mlp._fwd_launcher(dev, torch.float32, "ieee", False, False, False,
                                    None) is not inside
    if CUDA:
        from ckpt_ext.kernels import _launch
        with config.patch(autotune=False):
            kernel = swiglu_mlp._fwd_launcher(dev, torch.float16, "tf32", False, False, False,
                                              None)[0]
            assert isinstance(kernel, _launch.Pruned) and not kernel.autotune


@pytest.fixture
def launched(monkeypatch):
    """The (kind, dq_atomic) of every attention launcher the backward asks for (dq_atomic
    "ordered" for the ordered dQ sums)."""
    calls = []
    real = attention._launcher

    def spy(kind, *spec, **kw):
        calls.append((kind, "ordered" if kw.get("ordered") else
                      bool(spec[8]) if len(spec) > 8 else False))
        return real(kind, *spec, **kw)

    monkeypatch.setattr(attention, "_launcher", spy)
    return calls


def _inputs(dtype=torch.float32, S=37):
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, h, S, 16, generator=g, dtype=torch.float64)
                     for h in (4, 2, 2, 4))
    mask = torch.ones(2, S, dtype=torch.bool)
    mask[1, -5:] = False
    return [t.to(device=DEVICE, dtype=dtype) for t in (q, k, v, dout)] + [mask.to(DEVICE)]


def _backward_kinds(calls):
    return [c for c in calls if c[0] != "fwd"]


@pytest.mark.parametrize("mode", ["separate", "atomic", "ordered"])
def test_patch_switches_the_dq_path(launched, mode):
    """The setting selects the launched kernels: dK/dV plus a dQ kernel, or the dK/dV kernel
    with the atomic or the ordered dQ; switched inside patch() and back after it."""
    q, k, v, dout, mask = _inputs()
    out, lse = attention.attention_fwd(q, k, v, mask, None, None, True, 0.25)
    with config.patch(attention_dq=mode):
        attention.attention_bwd(dout, q, k, v, out, lse, mask, None, None, True, 0.25)
    expected = {"separate": [("dkdv", False), ("dq", False)], "atomic": [("dkdv", True)],
                "ordered": [("dkdv", "ordered")]}[mode]
    assert _backward_kinds(launched) == expected
    launched.clear()
    attention.attention_bwd(dout, q, k, v, out, lse, mask, None, None, True, 0.25)
    assert _backward_kinds(launched) == [("dkdv", False), ("dq", False)]


@pytest.fixture
def modes_table(tmp_path):
    """A choice table whose backward rule (any device) lists Triton's dQ modes atomic, ordered,
    separate, fastest first, in effect with attention_dq "auto"."""
    import json

    from ckpt_ext import attention_route

    path = tmp_path / "modes.json"
    path.write_text(json.dumps({"format": attention_route.TABLE_FORMAT, "rules": [
        {"phase": "bwd", "backends": ["triton:atomic", "triton:ordered", "triton:separate"]}]}))
    with config.patch(attention_table=str(path), attention_dq="auto"):
        yield
    attention_route.forget_tables()


@pytest.fixture
def determinism_flag():
    """Sets torch.use_deterministic_algorithms (on, warn_only); the user's back after."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    yield lambda on, warn_only=False: torch.use_deterministic_algorithms(on, warn_only=warn_only)
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_auto_launches_the_tables_mode_torchs_flag_allows(launched, modes_table,
                                                          determinism_flag, monkeypatch):
    """attention_dq "auto" (the default) at the Triton launcher: the table's fastest dQ mode
    when torch's flag is off (atomic) and under warn_only (atomic, and one warning naming the
    op), the fastest deterministic one when it is on (ordered); ops.attention's
    deterministic= answers for the flag. The shipped table names no mode here: "separate"."""
    import threading
    import warnings

    from ckpt_ext import attention_route

    monkeypatch.setattr(attention_route, "_warned", threading.Event())
    q, k, v, dout, mask = _inputs()
    out, lse = attention.attention_fwd(q, k, v, mask, None, None, True, 0.25)
    runs = []
    for on, warn_only in ((False, False), (True, True), (True, True), (True, False)):
        determinism_flag(on, warn_only)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            attention.attention_bwd(dout, q, k, v, out, lse, mask, None, None, True, 0.25)
        runs.append(sum("ckpt_ext::attention_bwd" in str(w.message) for w in caught))
    assert _backward_kinds(launched) == [("dkdv", True)] * 3 + [("dkdv", "ordered")]
    assert runs == [0, 1, 0, 0]      # warn_only: one warning, once
    launched.clear()
    with _triton_ops():
        determinism_flag(False)
        _attention_grads(q, k, v, dout, mask, deterministic=True)
        determinism_flag(True)
        _attention_grads(q, k, v, dout, mask, deterministic=False)
        with config.patch(attention_table=""):
            _attention_grads(q, k, v, dout, mask)
    assert _backward_kinds(launched) == [("dkdv", "ordered"), ("dkdv", True),
                                         ("dkdv", False), ("dq", False)]


def _triton_ops():
    """The Triton launchers on CPU tensors (the interpreter), nothing to do on a GPU."""
    if CUDA:
        import contextlib
        return contextlib.nullcontext()
    return ckpt_ext.use_triton("cpu")


def _attention_grads(q, k, v, dout, mask, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ops.attention(*leaves, causal=True, scale=0.25, key_padding_mask=mask, **kw).backward(dout)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("deterministic", [True, False])
def test_attention_deterministic_selects_the_dq_path(launched, deterministic):
    """ops.attention(deterministic=): True launches the separate dQ kernel, False the atomic
    path, whatever the setting; both meet the accuracy rule against the fp64 reference."""
    q, k, v, dout, mask = _inputs()
    other = "atomic" if deterministic else "separate"
    with _triton_ops(), config.patch(attention_dq=other):
        grads = _attention_grads(q, k, v, dout, mask, deterministic=deterministic)
        assert config.current().attention_dq == other
    expected = [("dkdv", False), ("dq", False)] if deterministic else [("dkdv", True)]
    assert _backward_kinds(launched) == expected

    def reference_grads(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, _ = attention_reference(*leaves, mask, True, 0.25)
        out.backward(dout.to(dtype))
        return [t.grad for t in leaves]

    ref, base = reference_grads(torch.float64), reference_grads(torch.float32)
    scale = magnitude(*ref)
    for name, got, b, r in zip(("dq", "dk", "dv"), grads, base, ref):
        check_vs_baseline(name, got, b, r, FACTOR_GRAD, scale=scale)


def test_attention_deterministic_true_keeps_an_ordered_setting(launched):
    """deterministic=True under attention_dq="ordered" (deterministic too) keeps the ordered
    dQ sums; False still takes the atomic ones."""
    q, k, v, dout, mask = _inputs()
    with _triton_ops(), config.patch(attention_dq="ordered"):
        _attention_grads(q, k, v, dout, mask, deterministic=True)
        _attention_grads(q, k, v, dout, mask, deterministic=False)
    assert _backward_kinds(launched) == [("dkdv", "ordered"), ("dkdv", True)]


def test_attention_deterministic_default_follows_the_setting(launched):
    q, k, v, dout, mask = _inputs()
    with _triton_ops():
        _attention_grads(q, k, v, dout, mask)
        with config.patch(attention_dq="atomic"):
            _attention_grads(q, k, v, dout, mask)
    assert _backward_kinds(launched) == [("dkdv", False), ("dq", False), ("dkdv", True)]


def test_attention_deterministic_true_is_bitwise_reproducible():
    q, k, v, dout, mask = _inputs(torch.float16 if not CUDA else torch.bfloat16, S=70)
    with _triton_ops():
        first = _attention_grads(q, k, v, dout, mask, deterministic=True)
        second = _attention_grads(q, k, v, dout, mask, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("value", [1, 0, "yes", torch.tensor(True)])
def test_attention_deterministic_must_be_a_bool(value):
    q, k, v, _, _ = _inputs()
    with pytest.raises(TypeError, match="attention: deterministic must be None, True or "
                                        "False, got"):
        ops.attention(q, k, v, deterministic=value)


# ---- backend and use_triton ----------------------------------------------------------------------
def test_use_triton_is_public():
    assert ckpt_ext.use_triton is _backend.use_triton
    assert "use_triton" in ckpt_ext.__all__


def test_config_does_not_import_the_backend():
    """config is read by _backend (its settings), never the other way round: no import of
    _backend in config's source, and no re-export of what _backend defines."""
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(config))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                for a in n.names} | {n.module for n in ast.walk(tree)
                                     if isinstance(n, ast.ImportFrom) and n.module}
    assert "_backend" not in imported
    assert not hasattr(config, "use_triton") and "use_triton" not in config.__all__


@interpreter_only
def test_patch_backend_registers_the_triton_launchers(monkeypatch):
    calls = []
    real = attention.attention_fwd

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(attention, "attention_fwd", spy)
    if config.current().backend != "auto":
        pytest.skip("the session runs with CKPT_EXT_BACKEND=triton")
    q = torch.randn(1, 2, 9, 16)
    with config.patch(backend="triton"):
        torch.ops.ckpt_ext.attention_fwd(q, q, q, None, None, None, True, 0.25)
    assert calls == [1]
    torch.ops.ckpt_ext.attention_fwd(q, q, q, None, None, None, True, 0.25)  # ATen's again
    assert calls == [1]


def test_kernels_folder_still_imports_as_top_level_package():
    """From the repository root the kernels/ folder is also found as a top-level ``kernels``
    (transformers probes for PyPI's package of that name): its __init__ must import there,
    so it reads the config only inside its functions."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__)"],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


# ---- the chunk cap -----------------------------------------------------------------------------
@pytest.mark.parametrize("text, value", [("", 64 << 20), ("4096", 4096), ("16MiB", 16 << 20),
                                         ("64 MB", 64 * 10**6), ("1.5GiB", 3 << 29),
                                         ("1TiB", 1 << 40), ("2kb", 2000)])
def test_chunk_bytes_is_parsed_once_and_reaches_the_kernels(text, value):
    """CKPT_EXT_CHUNK_BYTES is read by the package's one byte parser (config.parse_bytes, the
    plan's too) and the C++ kernels read the parsed value (ckpt_ext._C.chunk_bytes)."""
    assert config.from_environment({"CKPT_EXT_CHUNK_BYTES": text}).chunk_bytes == value
    assert config.parse_bytes(text or "64MiB", "x") == value
    with config.patch(chunk_bytes=text) as settings:
        assert settings.chunk_bytes == value == ckpt_ext._C.chunk_bytes()
    assert ckpt_ext._C.chunk_bytes() == config.current().chunk_bytes
    config.update(chunk_bytes=value)   # the conftest restores it after the test
    assert ckpt_ext._C.chunk_bytes() == value


@pytest.mark.parametrize("bad", ["0", "-1", "1 PiB", "1.5 TiB", "lots", 0, -3, 1.0, True])
def test_bad_chunk_bytes_name_the_setting(bad):
    with pytest.raises(ValueError, match=r"chunk_bytes \(CKPT_EXT_CHUNK_BYTES\) must be a "
                                         r"positive number of bytes"):
        config.patch(chunk_bytes=bad).__enter__()
    if isinstance(bad, str):
        with pytest.raises(ValueError, match="^CKPT_EXT_CHUNK_BYTES must be a positive"):
            config.from_environment({"CKPT_EXT_CHUNK_BYTES": bad})
    assert ckpt_ext._C.chunk_bytes() == config.current().chunk_bytes
