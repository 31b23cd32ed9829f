"""ckpt_ext.checkpoint against an uncheckpointed run and torch.utils.checkpoint."""
import gc
import re
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointError
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckpt_ext
from ckpt_ext import checkpoint
from reference import FACTOR_GRAD, check_vs_baseline


def torch_ckpt(fn, *args, **kwargs):
    return torch_checkpoint(fn, *args, use_reentrant=False, **kwargs)


def grads_of(tensors):
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def clear(tensors):
    for t in tensors:
        t.grad = None


WRAPS = {"plain": lambda f, *a, **k: f(*a, **k), "torch": lambda f, *a, **k: torch_ckpt(f, *a, **k),
         "ours": lambda f, *a, **k: checkpoint(f, *a, **k)}


def run_three_ways(fn, leaves, make_args, loss=lambda out: out.sum(), seed=123):
    """Forward+backward of fn plainly, under torch's checkpoint and under ours; returns
    (outputs, grads) per mode with the RNG reseeded identically before each."""
    results = {}
    for name, wrap in WRAPS.items():
        clear(leaves)
        torch.manual_seed(seed)
        args, kwargs = make_args()
        out = wrap(fn, *args, **kwargs)
        loss(out).backward()
        results[name] = (out, grads_of(leaves))
    return results


def assert_same(results, exact=True):
    ref_out, ref_grads = results["plain"]
    for name in ("torch", "ours"):
        out, grads = results[name]
        for a, b in zip(torch.utils._pytree.tree_leaves(ref_out),
                        torch.utils._pytree.tree_leaves(out)):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(b, a, rtol=0, atol=0) if exact else \
                    torch.testing.assert_close(b, a)
            else:
                assert a == b
        for ga, gb in zip(ref_grads, grads):
            assert (ga is None) == (gb is None), name
            if ga is not None:
                torch.testing.assert_close(gb, ga, rtol=0, atol=0) if exact else \
                    torch.testing.assert_close(gb, ga)


class MLP(nn.Module):
    def __init__(self, d=12, h=20, p=0.0):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, h), nn.Linear(h, d), nn.Dropout(p)

    def forward(self, x):
        return self.fc2(self.drop(F.gelu(self.fc1(x))))

    def method(self, x, scale):
        return self.forward(x) * scale


# ---- gradients reach everything ------------------------------------------------------------

def test_gradcheck_fp64():
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    fn = lambda x, b: torch.tanh(x @ w + b).sin()  # noqa: E731
    assert torch.autograd.gradcheck(lambda x, b, w_: checkpoint(lambda x, b: torch.tanh(x @ w_ + b).sin(), x, b),
                                    (x, b, w))
    assert torch.autograd.gradcheck(lambda x, b: checkpoint(fn, x, b), (x, b))


@pytest.mark.parametrize("how", ["module", "bound_method", "closure", "lambda_global"])
def test_parameters_get_gradients(how):
    model = MLP()
    x = torch.randn(7, 12, requires_grad=True)
    if how == "module":
        fn, make = model, lambda: ((x,), {})
    elif how == "bound_method":
        fn, make = model.method, lambda: ((x, 0.5), {})
    elif how == "closure":
        w = torch.randn(12, 12, requires_grad=True)

        def fn(a):
            return model(a @ w)
        make = lambda: ((x,), {})  # noqa: E731
    else:
        fn, make = (lambda a: MODEL_GLOBAL(a)), lambda: ((x,), {})
    leaves = [x] + list(model.parameters()) + list(MODEL_GLOBAL.parameters())
    if how == "closure":
        leaves.append(w)
    assert_same(run_three_ways(fn, leaves, make))


MODEL_GLOBAL = MLP()


def test_no_argument_requires_grad():
    model = MLP()
    x = torch.randn(4, 12)
    results = run_three_ways(model, list(model.parameters()), lambda: ((x,), {}))
    assert_same(results)
    assert results["ours"][0].requires_grad


def test_closure_over_non_leaf_tensor():
    base = torch.randn(12, 12, requires_grad=True)
    x = torch.randn(4, 12, requires_grad=True)
    grads = []
    for wrap in (checkpoint, lambda f, a: f(a)):
        clear([base, x])
        scaled = base * 3  # non-leaf computed before the segment, read by the closure
        fn = lambda a: torch.tanh(a @ scaled)  # noqa: E731
        wrap(fn, x).sum().backward()
        grads.append(grads_of([base, x]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_autograd_grad_and_backward_inputs():
    model = MLP()
    x = torch.randn(4, 12, requires_grad=True)
    out = checkpoint(model, x)
    gw, gx = torch.autograd.grad(out.square().sum(), inputs=[model.fc1.weight, x])
    ref_w, ref_x = torch.autograd.grad(model(x).square().sum(), inputs=[model.fc1.weight, x])
    torch.testing.assert_close(gw, ref_w, rtol=0, atol=0)
    torch.testing.assert_close(gx, ref_x, rtol=0, atol=0)
    assert model.fc1.weight.grad is None and x.grad is None

    checkpoint(model, x).sum().backward(inputs=[model.fc2.bias])
    assert x.grad is None and model.fc1.weight.grad is None
    ref = torch.autograd.grad(model(x).sum(), model.fc2.bias)[0]
    torch.testing.assert_close(model.fc2.bias.grad, ref, rtol=0, atol=0)


def test_closure_over_leaf_and_tensor_derived_from_it():
    # The segment reads w and a tensor computed from w before it: w's gradient must count the
    # path through `scaled` once (outside the segment), not once more inside the recompute.
    w = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    grads = {}
    for name, wrap in WRAPS.items():
        clear([w, x])
        scaled = w * 3
        wrap(lambda a: torch.tanh(a @ scaled) @ w, x).sum().backward()
        grads[name] = grads_of([w, x])
    for name in ("torch", "ours"):
        for a, b in zip(grads["plain"], grads[name]):
            torch.testing.assert_close(b, a)


# ---- double backward -----------------------------------------------------------------------

class GeluMLP(nn.Module):
    """fp64, smooth (tanh-GELU has non-zero second derivatives everywhere)."""

    def __init__(self, d=6, h=10):
        super().__init__()
        self.fc1 = nn.Linear(d, h, dtype=torch.float64)
        self.fc2 = nn.Linear(h, d, dtype=torch.float64)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def second_order(wrap, fn, leaves, make_args, seed=11):
    """First-order gradients of a loss with create_graph=True, then backward of a function of
    them: returns (first-order gradients, second-order gradients in .grad)."""
    clear(leaves)
    torch.manual_seed(seed)
    out = wrap(fn, *make_args())
    first = torch.autograd.grad(out.square().sum(), leaves, create_graph=True, allow_unused=True)
    assert all(g is None or g.requires_grad for g in first)
    sum((g.sin() * (i + 1)).sum() for i, g in enumerate(first) if g is not None).backward()
    return [None if g is None else g.detach() for g in first], grads_of(leaves)


@pytest.mark.parametrize("case", ["args", "module", "input_from_outside_leaf", "nested", "dropout"])
def test_double_backward_matches_torch_fp64(case):
    dt = torch.float64
    x = torch.randn(5, 6, dtype=dt, requires_grad=True)
    if case == "args":
        w = torch.randn(6, 6, dtype=dt, requires_grad=True)
        b = torch.randn(6, dtype=dt, requires_grad=True)
        fn, leaves = (lambda a, b_, w_: torch.tanh(a @ w_ + b_).sin()), [x, b, w]
        make = lambda: (x, b, w)  # noqa: E731
    elif case == "module":
        model = GeluMLP()
        fn, leaves, make = model, [x] + list(model.parameters()), lambda: (x,)
    elif case == "input_from_outside_leaf":
        # w is read inside the segment and also reaches it through the argument.
        w = torch.randn(5, 6, dtype=dt, requires_grad=True)
        fn, leaves, make = (lambda t: (w * t).tanh() * w), [x, w], lambda: (w * x,)
    elif case == "nested":
        inner, outer = GeluMLP(), nn.Linear(6, 6, dtype=dt)
        fn = lambda t: outer(checkpoint(inner, t.tanh()) * t)  # noqa: E731
        leaves, make = [x] + list(inner.parameters()) + list(outer.parameters()), lambda: (x,)
    else:
        w = torch.randn(6, 6, dtype=dt, requires_grad=True)
        fn = lambda t: F.dropout(torch.tanh(t @ w), 0.5, training=True).sin()  # noqa: E731
        leaves, make = [x, w], lambda: (x,)
    results = {name: second_order(wrap, fn, leaves, make) for name, wrap in WRAPS.items()}
    for name in ("torch", "ours"):
        for part in (0, 1):
            for ref, got in zip(results["plain"][part], results[name][part]):
                assert (ref is None) == (got is None), (name, part)
                if ref is not None:
                    torch.testing.assert_close(got, ref)
    assert any(g is not None and g.abs().sum() > 0 for g in results["ours"][1])


def test_gradgradcheck_fp64():
    dt = torch.float64
    w = torch.randn(5, 4, dtype=dt, requires_grad=True)
    x = torch.randn(3, 5, dtype=dt, requires_grad=True)
    b = torch.randn(4, dtype=dt, requires_grad=True)

    def one(x, b, w_):
        return checkpoint(lambda x, b: torch.tanh(x @ w_ + b).sin(), x, b)

    def nested(x, b, w_):
        return checkpoint(lambda t: checkpoint(lambda u: torch.tanh(u @ w_), t.sin()) + b, x)

    for f in (one, nested):
        assert torch.autograd.gradcheck(f, (x, b, w))
        assert torch.autograd.gradgradcheck(f, (x, b, w))


def test_create_graph_gradient_reaches_original_tensors():
    # The first-order gradient of a checkpointed segment is a function of the real inputs and
    # parameters: differentiating it gives d/dx (d out/dw) and d/dw (d out/dx), not zeros.
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out = checkpoint(lambda t: (t * w).exp(), x * 1.0)
    gw, = torch.autograd.grad(out.sum(), w, create_graph=True)
    ggx, ggw = torch.autograd.grad(gw.sum(), [x, w])
    e = (x * w).exp().detach()
    torch.testing.assert_close(ggx, e + x.detach() * w.detach() * e)
    torch.testing.assert_close(ggw, x.detach() ** 2 * e)


# ---- tensor hooks --------------------------------------------------------------------------

def test_leaf_hook_fires_once_like_torch():
    seen = {}
    for name, wrap in WRAPS.items():
        torch.manual_seed(0)
        w = torch.randn(10, 10, requires_grad=True)
        calls = []
        w.register_hook(lambda g: calls.append(g.clone()))
        x = torch.rand(10, 10, requires_grad=True)
        wrap(lambda t: w * t, w * x).sum().backward()
        seen[name] = calls
    assert len(seen["plain"]) == len(seen["torch"]) == 1
    assert len(seen["ours"]) == 1
    torch.testing.assert_close(seen["ours"][0], seen["plain"][0], rtol=0, atol=0)


def test_module_parameter_hooks_fire_like_torch():
    # Parameters used inside the segment and again outside it; a tensor hook that rescales the
    # gradient (as clipping or PEFT hooks do) and a post-accumulate-grad hook on each.
    results = {}
    for name, wrap in WRAPS.items():
        torch.manual_seed(0)
        model = MLP()
        x = torch.randn(6, 12, requires_grad=True)
        counts = {}
        for pname, p in model.named_parameters():
            counts[pname] = [0, 0]
            p.register_hook(lambda g, c=counts[pname]: (c.__setitem__(0, c[0] + 1), g * 0.5)[1])
            p.register_post_accumulate_grad_hook(
                lambda p, c=counts[pname]: c.__setitem__(1, c[1] + 1))
        model(wrap(model, x)).square().sum().backward()
        results[name] = (counts, grads_of([x] + list(model.parameters())))
    assert results["ours"][0] == results["torch"][0] == results["plain"][0]
    assert all(c == [1, 1] for c in results["ours"][0].values())
    for name in ("torch", "ours"):
        for a, b in zip(results["plain"][1], results[name][1]):
            torch.testing.assert_close(b, a)


def test_non_leaf_outside_tensor_hook_and_retain_grad():
    results = {}
    for name, wrap in WRAPS.items():
        torch.manual_seed(0)
        base = torch.randn(8, 8, requires_grad=True)
        x = torch.randn(3, 8, requires_grad=True)
        scaled = base * 3
        scaled.retain_grad()
        calls = []
        scaled.register_hook(lambda g: calls.append(1))
        wrap(lambda a: torch.tanh(a @ scaled), x).sum().backward()
        results[name] = (len(calls), scaled.grad, base.grad)
    assert results["ours"][0] == results["torch"][0] == 1
    for i in (1, 2):
        torch.testing.assert_close(results["ours"][i], results["plain"][i], rtol=0, atol=0)


# ---- arguments and results -----------------------------------------------------------------

def test_pytree_arguments_and_results():
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(3, 4, requires_grad=True)
    c = torch.randn(4, requires_grad=True)

    def fn(pair, cfg, *, extra=None, name="x"):
        x, y = pair
        out = {"sum": x * cfg["k"] + y.sin(), "list": [x.exp(), None, name, 3], "c": extra * 2}
        return out, len(name)

    def make():
        return ([a, b], {"k": 2.5, "unused": None}), {"extra": c, "name": "abc"}

    loss = lambda out: out[0]["sum"].sum() + out[0]["list"][0].sum() + out[0]["c"].sum()  # noqa
    results = run_three_ways(fn, [a, b, c], make, loss=loss)
    assert_same(results)
    out = results["ours"][0]
    assert out[1] == 3 and out[0]["list"][1:] == [None, "abc", 3]


def test_several_outputs_some_without_grad():
    x = torch.randn(5, requires_grad=True)
    y = torch.randn(5)  # does not require grad

    def fn(x, y):
        return x.sin(), y.cos(), x.argmax(), x.detach() * 2

    outs = checkpoint(fn, x, y)
    ref = torch_ckpt(fn, x, y)
    assert [o.requires_grad for o in outs] == [o.requires_grad for o in ref] == [True, False, False, False]
    outs[0].sum().backward()
    torch.testing.assert_close(x.grad, x.detach().cos(), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="does not require grad"):
        outs[1].sum().backward()


def test_input_returned_unchanged():
    x = torch.randn(4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    a, b = checkpoint(lambda x, w: (x, x * w), x, w)
    torch.testing.assert_close(a, x, rtol=0, atol=0)
    (a.sum() * 3 + b.sum()).backward()
    torch.testing.assert_close(x.grad, 3 + w.detach(), rtol=0, atol=0)
    torch.testing.assert_close(w.grad, x.detach(), rtol=0, atol=0)


def test_non_tensor_only_results_and_args():
    assert checkpoint(lambda a, b: a + b, 2, 3) == 5
    x = torch.randn(3, requires_grad=True)
    assert checkpoint(lambda t: None, x) is None


# ---- RNG and autocast ----------------------------------------------------------------------

def test_dropout_replayed_and_caller_rng_untouched():
    model = MLP(p=0.5)
    x = torch.randn(16, 12, requires_grad=True)
    leaves = [x] + list(model.parameters())
    assert_same(run_three_ways(model, leaves, lambda: ((x,), {})))

    torch.manual_seed(5)
    out = checkpoint(model, x)
    state_before_backward = torch.get_rng_state()
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), state_before_backward)


def test_rng_without_preservation_differs():
    # With preserve_rng_state=False the recomputation draws fresh numbers: the gradient of
    # a dropout segment no longer matches; this shows the preserved path is doing the work.
    x = torch.ones(4000, requires_grad=True)
    fn = lambda t: F.dropout(t, 0.5, training=True)  # noqa: E731
    torch.manual_seed(0)
    out = checkpoint(fn, x, preserve_rng_state=False)
    out.sum().backward()
    assert not torch.equal(x.grad, (out.detach() != 0).float() * 2)
    x.grad = None
    torch.manual_seed(0)
    out = checkpoint(fn, x)
    out.sum().backward()
    torch.testing.assert_close(x.grad, (out.detach() != 0).float() * 2, rtol=0, atol=0)


def test_autocast_state_replayed():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    seen = []

    def fn(t):
        y = lin(t)
        seen.append((torch.is_autocast_enabled("cpu"), y.dtype))
        return y.float().sin()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = checkpoint(fn, x)
    out.sum().backward()  # outside autocast: the recomputation must still run under it
    assert seen == [(True, torch.bfloat16), (True, torch.bfloat16)]
    assert not torch.is_autocast_enabled("cpu")
    gx = x.grad.clone()
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch_ckpt(fn, x)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(gx, x.grad, rtol=0, atol=0)


# ---- calls, lifetimes, graphs --------------------------------------------------------------

def test_no_grad_calls_once():
    calls = []
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        out = checkpoint(lambda t: calls.append(1) or t * 2, x)
    assert calls == [1] and not out.requires_grad


def test_runs_twice_and_frees_intermediates():
    calls, refs = [], []
    x = torch.randn(64, 64, requires_grad=True)

    def fn(t):
        calls.append(1)
        mid = t.sin()
        refs.append(weakref.ref(mid))
        return mid.cos()

    out = checkpoint(fn, x)
    gc.collect()
    assert len(calls) == 1 and refs[0]() is None  # the forward intermediate is gone
    out.sum().backward()
    assert len(calls) == 2
    # A plain run keeps it alive through the graph: the weakref check can fail.
    plain_refs = []
    y = (lambda t: (plain_refs.append(weakref.ref(m := t.sin())), m.cos())[1])(x)
    gc.collect()
    assert plain_refs[0]() is not None
    del y


def test_retain_graph_and_second_backward_accumulate():
    model = MLP()
    x = torch.randn(4, 12, requires_grad=True)
    out = checkpoint(model, x)
    out.sum().backward(retain_graph=True)
    first = x.grad.clone()
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2 * first, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()


def test_nondeterministic_function_raises():
    x = torch.randn(4, requires_grad=True)
    calls = []

    def grows(t):
        calls.append(1)
        return t.repeat(len(calls))

    with pytest.raises(CheckpointError, match="not deterministic"):
        checkpoint(grows, x).sum().backward()

    def flips_dtype(t):
        calls.append(1)
        return t.double() if len(calls) % 2 == 0 else t * 1

    calls.clear()
    with pytest.raises(CheckpointError, match="not deterministic"):
        checkpoint(flips_dtype, x).sum().backward()

    def more_outputs(t):
        calls.append(1)
        return (t * 2,) * (len(calls) % 2 + 1)

    calls.clear()
    with pytest.raises(CheckpointError, match="not deterministic"):
        sum(o.sum() for o in checkpoint(more_outputs, x)).backward()


def _diverging(case):
    """A segment whose recomputation computes something else than its forward (its closure
    changes after forward): (fn, expected message)."""
    state = {"fwd": True}
    w1 = torch.randn(6, 6, requires_grad=True)
    w2 = torch.randn(6, 6, requires_grad=True)
    if case == "branch":  # data-dependent control flow: one more operation
        fn = lambda t: t.sin() if state["fwd"] else t.sin().sin()  # noqa: E731
        msg = r"recorded 2 operations in its autograd graph where forward recorded 1"
    elif case == "intermediate_shape":  # same output, an intermediate of another shape
        def fn(t):
            n = 4 if state["fwd"] else 3
            return (t[:, :n] @ w1[:n]).tanh()
        msg = (r"SliceBackward0, with outputs \w+\[(5, 3|3, 6)\] on cpu where forward had "
               r"\w+\[(5, 4|4, 6)\] on cpu")
    elif case == "other_op":  # same shapes, another operation
        fn = lambda t: (t.sin() if state["fwd"] else t.cos()) @ w1  # noqa: E731
        msg = r"operation \d+ of its autograd graph as CosBackward0 where forward had SinBackward0"
    elif case == "other_tensor":  # same graph, another parameter of the same shape
        fn = lambda t: t @ (w1 if state["fwd"] else w2)  # noqa: E731
        msg = r"reads a tensor that requires grad which the forward did not"
    else:  # an unused parameter the forward read
        fn = lambda t: (t @ w1) * (w2 if state["fwd"] else w1)[0]  # noqa: E731
        msg = r"no longer reads a tensor the forward read"
    return fn, state, msg


@pytest.mark.parametrize("case", ["branch", "intermediate_shape", "other_op", "other_tensor",
                                  "dropped_tensor"])
def test_recompute_that_differs_raises_checkpoint_error(case):
    fn, state, msg = _diverging(case)
    x = torch.randn(5, 6, requires_grad=True)
    out = checkpoint(fn, x)
    state["fwd"] = False
    with pytest.raises(CheckpointError, match=msg):
        out.sum().backward()
    assert issubclass(CheckpointError, RuntimeError)


def test_determinism_check_none_skips_the_comparison():
    fn, state, _ = _diverging("other_op")
    x = torch.randn(5, 6, requires_grad=True)
    out = checkpoint(fn, x, determinism_check="none")
    state["fwd"] = False
    out.sum().backward()  # the gradient of the recomputed function: nothing compared
    ref = x.detach().requires_grad_()
    fn(ref).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=0)
    with pytest.raises(ValueError, match="determinism_check"):
        checkpoint(fn, x, determinism_check="strict")


def test_autocast_weight_cast_cached_before_the_segment():
    # Under autocast the bf16 copy of a weight is cached for the region: a segment that reads a
    # weight already cast outside it must still send the weight its gradient, and must not be
    # taken for a segment whose recomputation differs. The segment casts the weight itself
    # (the cache is off inside it), so its bf16 gradient is not summed in bf16 with the other
    # uses' as in a plain run: compared with the float64 result, as plain bf16 autocast is.
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    leaves = [x] + list(lin.parameters())

    def step(wrap, autocast=True):
        clear(leaves)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y0 = lin(x)  # caches the bf16 weight
            out = wrap(lambda t: lin(t).float().sin(), x) + y0.float()
            out2 = wrap(lambda t: lin(t).float().cos(), x)  # the same weight, second segment
        (out.sum() + out2.sum()).backward()
        return grads_of(leaves)

    grads = {name: step(wrap) for name, wrap in WRAPS.items()}
    lin.double()
    x.data = x.data.double()
    ref = step(WRAPS["plain"], autocast=False)
    for a, b in zip(grads["plain"], grads["torch"]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    for name, got, base, r in zip(("dx", "dweight", "dbias"), grads["ours"], grads["plain"], ref):
        check_vs_baseline(name, got, base, r, FACTOR_GRAD, torch.bfloat16)



def test_inplace_on_a_saved_tensor_still_detected():
    # The recomputation saves through hooks (to compare with the forward); the version check
    # autograd does without hooks must survive.
    def fn(t):
        y = t.exp()
        y.add_(1)  # exp saved y for backward
        return y

    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fn(x).sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        checkpoint(fn, x).sum().backward()

def test_inplace_change_of_a_no_grad_input_raises():
    """A segment that changes an input that needs no gradient in place would be recomputed on
    the changed value (wrong gradients): refused, naming the argument, as torch's checkpoint
    refuses it with its version check. Cloning first gives plain PyTorch's gradients."""
    W = torch.randn(4, 5, requires_grad=True)
    x0 = torch.randn(3, 4)
    for fn, args, kwargs, where in (
            (lambda a: a.add_(1) @ W, (x0.clone(),), {}, "argument 0"),
            (lambda a: a[0].zero_() @ W, (x0.clone(),), {}, "argument 0"),  # a view of it
            (lambda a, b: (a @ W) * b.mul_(2).sum(), (x0.clone(), x0.clone()), {}, "argument 1"),
            (lambda a, *, mask: (a @ W) * mask.relu_().sum(), (x0.clone(),),
             {"mask": x0.clone()}, "keyword argument 'mask'"),
            (lambda pair: pair[1].add_(1) @ W, ([3, x0.clone()],), {}, "argument 0[1]")):
        with pytest.raises(RuntimeError,
                           match=re.escape(f"changed its {where} (float32[") + r".*\]\) in place"):
            checkpoint(fn, *args, **kwargs)
    # nothing requires grad: nothing is recomputed, so the change is the caller's business
    a = x0.clone()
    torch.testing.assert_close(checkpoint(lambda t: t.add_(1) * 2, a), (x0 + 1) * 2)
    torch.testing.assert_close(a, x0 + 1)
    # the fix the message suggests: the same gradients as plain PyTorch
    W.grad = None
    out = checkpoint(lambda t: t.clone().add_(1) @ W, x0.clone())
    out.pow(2).sum().backward()
    got, W.grad = W.grad, None
    ((x0 + 1) @ W).pow(2).sum().backward()
    torch.testing.assert_close(got, W.grad, rtol=0, atol=0)


def test_inplace_change_of_an_input_that_requires_grad_says_what_happened():
    """A non-leaf input that requires grad changed in place inside the segment: the error
    says so (not 'a leaf Variable', which the input is not). A leaf input keeps autograd's
    leaf error, which is true of it, and is left unchanged."""
    W = torch.randn(4, 4, requires_grad=True)
    a0 = torch.randn(3, 4, requires_grad=True)
    a = a0 * 2
    with pytest.raises(RuntimeError) as err:
        checkpoint(lambda t: t.add_(1) @ W, a)
    msg = str(err.value)
    assert "changed its argument 0 (float32[3, 4], which requires grad) in place" in msg
    assert "leaf" not in msg
    with pytest.raises(RuntimeError, match="keyword argument 'x'.*which requires grad"):
        checkpoint(lambda *, x: x.mul_(3).sum(), x=a0 * 2)
    before = a0.detach().clone()
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        checkpoint(lambda t: t.add_(1) @ W, a0)
    assert torch.equal(a0.detach(), before)
    # without the in-place change the non-leaf input gets plain PyTorch's gradients
    a0.grad = W.grad = None
    checkpoint(lambda t: torch.tanh(t) @ W, a0 * 2).sum().backward()
    got = (a0.grad, W.grad)
    a0.grad = W.grad = None
    (torch.tanh(a0 * 2) @ W).sum().backward()
    torch.testing.assert_close(got, (a0.grad, W.grad), rtol=0, atol=0)


def test_nested_checkpoints():
    inner, outer_extra = MLP(), nn.Linear(12, 12)
    x = torch.randn(5, 12, requires_grad=True)
    fn = lambda t: outer_extra(checkpoint(inner, t.tanh()) + t)  # noqa: E731
    leaves = [x] + list(inner.parameters()) + list(outer_extra.parameters())
    assert_same(run_three_ways(fn, leaves, lambda: ((x,), {})))


def test_exception_propagates_and_leaves_no_state():
    x = torch.randn(3, requires_grad=True)

    def boom(t):
        t.sin()
        raise ValueError("boom inside fn")

    with pytest.raises(ValueError, match="boom inside fn"):
        checkpoint(boom, x)
    # Grad mode on, no saved-tensor hooks left installed: a plain op saves normally.
    assert torch.is_grad_enabled()
    y = x.sin()
    assert y.grad_fn._saved_self is not None
    calls = []

    def fails_in_backward(t):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("boom in recompute")
        return t.sin()

    out = checkpoint(fails_in_backward, x)
    with torch.autocast("cpu", enabled=False):
        with pytest.raises(ValueError, match="boom in recompute"):
            out.sum().backward()
    assert not torch.is_autocast_enabled("cpu")
    (x * 2).sum().backward()  # autograd still works afterwards
    torch.testing.assert_close(x.grad, torch.full_like(x, 2))


def test_torch_only_keywords():
    x = torch.randn(3, requires_grad=True)
    out = checkpoint(torch.sin, x, use_reentrant=False, determinism_check="default")
    torch.testing.assert_close(out, x.sin())
    with pytest.raises(NotImplementedError, match="use_reentrant=True"):
        checkpoint(torch.sin, x, use_reentrant=True)
    with pytest.raises(TypeError, match="fn must be callable"):
        checkpoint(3, x)


def test_saves_only_inputs():
    model = MLP(12, 256)
    x = torch.randn(32, 12, requires_grad=True)
    assert ckpt_ext.saved_activation_bytes(checkpoint, model, x) == x.numel() * 4
    assert ckpt_ext.saved_activation_bytes(torch_ckpt, model, x) == x.numel() * 4
    assert ckpt_ext.saved_activation_bytes(model, x) > 10 * x.numel() * 4


@pytest.mark.gpu(reason="needs a CUDA GPU (CUDA generator)")
def test_cuda_dropout_replayed_and_cuda_rng_untouched():
    model = MLP(p=0.5).cuda()
    x = torch.randn(64, 12, device="cuda", requires_grad=True)
    leaves = [x] + list(model.parameters())
    assert_same(run_three_ways(model, leaves, lambda: ((x,), {})))
    torch.manual_seed(5)
    out = checkpoint(model, x)
    cuda_state = torch.cuda.get_rng_state()
    out.sum().backward()
    assert torch.equal(torch.cuda.get_rng_state(), cuda_state)
