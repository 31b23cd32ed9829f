"""The tiny Hugging Face models and batches that the HF tests build (transformers required).

Each test module keeps its own config values and names them here: ``tiny_model`` makes a model
of a family from them, seeded; ``padded_batch`` a left-padded batch with its labels;
``assert_compiled_replays_eager`` the torch.compile check of a patched model.
"""
import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM


def tiny_model(family="llama", config=None, *, impl="sdpa", cls=AutoModelForCausalLM, seed=0,
               perturb=False, bias_noise=0.1):
    """``cls`` of ``family`` from the ``config`` values, its init seeded with ``seed``. With
    ``perturb`` the weights move off that init, so that norms, biases and projections all
    matter: norm weights 1 + 0.3 noise, biases ``bias_noise`` * noise (None: as the
    projections), the rest + 0.05 noise. Skips when transformers has no such family."""
    try:
        cfg = AutoConfig.for_model(family, **(config or {}))
    except ValueError:
        pytest.skip(f"transformers {transformers.__version__} has no {family} models")
    torch.manual_seed(seed)
    model = cls.from_config(cfg, attn_implementation=impl)
    if perturb:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                if "norm" in name:
                    p.copy_(1.0 + 0.3 * noise)
                elif bias_noise is not None and name.endswith("bias"):
                    p.copy_(bias_noise * noise)
                else:
                    p.add_(0.05 * noise)
    return model


def padded_batch(vocab, b, s, *, pad_row=0, pad=5, seed=1, shift=True):
    """(input_ids, attention_mask, labels), each (b, s): ids drawn from [1, vocab) with
    ``seed``, row ``pad_row`` left-padded by ``pad`` tokens (id 0, mask 0, label -100); with
    ``shift`` also the label that a padded position predicts is -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[pad_row, :pad] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if shift:
        labels[:, 1:][mask[:, :-1] == 0] = -100  # predicted from a padded position
    return ids.masked_fill(mask == 0, 0), mask, labels


def assert_compiled_replays_eager(model, loss_and_grads, batch, loss_tol, grad_tol, **call):
    """torch.compile of a patched model: no graph break (dynamo's explain of a forward with
    ``batch`` = (ids, mask, labels) and the keywords ``call``), and under aot_eager the eager
    loss (``loss_tol``) and every gradient (``grad_tol``) for the same torch.manual_seed (LoRA
    dropout seeds are drawn from it). ``loss_and_grads(model, ids, mask, labels)`` -> (loss,
    {name: grad}) with compile's "_orig_mod." prefix removed."""
    ids, mask, labels = batch
    explain = torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask, labels=labels,
                                           **call)
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    torch.manual_seed(7)
    loss_e, grads_e = loss_and_grads(model, ids, mask, labels)
    compiled = torch.compile(model, backend="aot_eager")
    torch.manual_seed(7)
    loss_c, grads_c = loss_and_grads(compiled, ids, mask, labels)
    torch.testing.assert_close(loss_c, loss_e, **loss_tol)
    assert grads_c.keys() == grads_e.keys()
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, **grad_tol, msg=name)
