"""The planner's command line: ``python -m ckpt_ext.plan CONFIG --batch B --seq S [--dtype bf16]
[--budget 20GiB] [--device-memory 80GiB --weights lora [--shard N] [--offload [--host-memory
200GiB] [--offload-stream]]] [--segment-layers K|auto] [--sequence-parallel N] [--throughputs
FILE]`` (``--help`` says what each means).

It reads a model's shape from an HF config (``ckpt_ext.hf.families.layer_dims_from_config``:
the family decides which output norms the layers have) and prints the figures of
``ckpt_ext.plan``, which depends on the layer records alone. Sums are Python ints; the CLI
bounds its inputs (S up to 2**32, B up to 2**20, bytes up to 1 EiB) with a usage error.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import types
from typing import Optional, Sequence

from .hf.families import layer_dims_from_config
from .hf.patch import _model_config
from .plan import (_DTYPES, _PATHS, AUTO_CHOICES, FRAGMENTATION, HOST_LINK_GBYTES_PER_S,
                   LORA_RANK, OFFLOAD_SETUPS, PEAK_SETUPS, QUANTS, SP_LINK_GBYTES_PER_S,
                   choose_auto, choose_chunk_rows, choose_segment_layers,
                   longest_sequence_segments,
                   choose_presets_offload, format_bytes, head_saved_bytes, headroom_bytes,
                   layer_bytes, longest_sequence, longest_sequence_offload,
                   model_state_bytes, offload_step_peak, dequantized_bytes, stream_copy_bytes,
                   parse_bytes, recompute_flops, sp_exchange_bytes, sp_local_tokens,
                   sp_longest_sequence, sp_step_peak, sp_step_time, step_peak,
                   step_time_estimate)
from .presets import FUSED_PRESETS, per_token_bytes
from .throughputs import default_throughputs, load_throughputs

__all__ = ["main", "host_ram_bytes"]

# Bounds of the CLI's inputs: far past any real run (a billion-token sequence, an exabyte), and
# what keeps every figure printable.
_MAX = {"seq": 1 << 32, "batch": 1 << 20, "dim": 1 << 24, "layers": 1 << 16,
        "vocab": 1 << 32, "shard": 1 << 20, "gpus": 1 << 10}
_MAX_BYTES = 1 << 60


def _hf_hub_cache() -> str:
    """The local Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub (read at each call)."""
    return os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache",
                                                  "huggingface"), "hub")


def _hf_cache_config(model_id: str) -> Optional[str]:
    """The cached config.json of ``model_id`` (its ``main`` revision) in the local Hugging Face
    cache, or None; nothing is downloaded."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        try_to_load_from_cache = None
    if try_to_load_from_cache is not None:
        try:
            found = try_to_load_from_cache(model_id, "config.json", cache_dir=_hf_hub_cache())
        except Exception:    # a malformed id: not in the cache
            return None
        return found if isinstance(found, str) else None
    repo = os.path.join(_hf_hub_cache(), "models--" + model_id.replace("/", "--"))
    try:
        with open(os.path.join(repo, "refs", "main")) as f:
            path = os.path.join(repo, "snapshots", f.read().strip(), "config.json")
    except OSError:
        return None
    return path if os.path.isfile(path) else None


class _ConfigView:
    """A config.json's object as patch_llama reads an HF config: its keys as attributes, and
    ``get_text_config()`` its ``text_config`` (itself without one, as HF's)."""

    def __init__(self, data: dict):
        self._data = data

    def __getattr__(self, name):
        try:
            return self._data[name]
        except KeyError:
            raise AttributeError(name) from None

    def get_text_config(self):
        text = self._data.get("text_config")
        return _ConfigView(text) if isinstance(text, dict) else self


def _patch_refusal(config: dict) -> Optional[str]:
    """Why ``patch_llama`` refuses a model of this config, in its own words (its check of the
    model's config, ``ckpt_ext.hf.patch._model_config``), or None; a config without
    ``model_type`` (dimensions alone) is not checked."""
    if "model_type" not in config:
        return None
    try:
        _model_config(types.SimpleNamespace(config=_ConfigView(config)))
    except (ValueError, NotImplementedError) as e:
        return str(e)
    return None


def _read_config(path: str) -> dict:
    """The config at ``path`` (a config.json, a model directory, or the id of a model in the
    local Hugging Face cache), its text config for a multimodal model; ValueError naming the
    file when it cannot be found or read or is not a JSON object, and with patch_llama's
    reason for a model it refuses (:func:`_patch_refusal`)."""
    if not os.path.exists(path) and re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        cached = _hf_cache_config(path)
        if cached is None:
            raise ValueError(
                f"{path!r} is neither a file nor a model in the local Hugging Face cache "
                f"(HF_HUB_CACHE); fetch its config with `hf download {path} config.json`, or "
                f"give a config.json path")
        path = cached
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    refusal = _patch_refusal(config) if isinstance(config, dict) else None
    if refusal:
        raise ValueError(f"{path}: {refusal}")
    if isinstance(config, dict) and "hidden_size" not in config:
        config = config.get("text_config", config)
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object (an HF config), got "
                         f"{type(config).__name__}")
    return config


def _bounded_int(limit: int):
    """argparse type: an int in [1, limit] (argparse names the option in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
        if value > limit:
            raise argparse.ArgumentTypeError(f"must be at most {limit:,}, got {text}")
        return value
    parse.__name__ = "int"
    return parse


_positive_int = _bounded_int(_MAX["dim"])


# The largest rate a flag or a --throughputs file may give (TFLOP/s, GB/s): past it a step's
# seconds round to 0.
_MAX_RATE = 1e9


def _segment_layers(text: str):
    """argparse type of --segment-layers: a positive int or 'auto' (argparse names the
    option in its error; the bound by the layer count is checked once the config is read)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int or 'auto', got {text!r}") \
            from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int or 'auto', got {value}")
    return value


_segment_layers.__name__ = "segment layers"


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not 0 < value < _MAX_RATE:
        raise argparse.ArgumentTypeError(f"must be a positive number below {_MAX_RATE:g}, got "
                                         f"{text}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text}")
    return value


def _table(rows, header):
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in
                               enumerate(zip(r, widths))).rstrip() for r in cells)


def _tflop(n: int) -> str:
    return f"{n / 1e12:.3f}"


def host_ram_bytes() -> Optional[int]:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


_WEIGHTS_HELP = (
    "what the device holds besides the step (with --device-memory): 'full' (default), a full "
    "fine-tune: fp32 master weights, fp32 gradients and AdamW's two fp32 moments, 16 bytes a "
    "parameter (Trainer(bf16=True) / autocast), about 120 GiB for an 8B model, so it needs "
    "--shard on an 80 GB GPU; 'lora', a frozen base in --dtype (2 bytes a parameter in bf16) "
    "plus rank-16 adapters on every projection trained in fp32 with AdamW (PEFT's default); "
    "'qlora', the same adapters on a bitsandbytes-quantized base (--quant; "
    "prepare_model_for_kbit_training's fp32 embeddings, norms and head), one layer's "
    "weights dequantized in --dtype at a time (counted in the step's peak); "
    "the step times count the adapters' GEMMs")

_EPILOG = """\
Will my run fit? Give the model, --batch, --seq and --device-memory (and --weights lora for
LoRA). For each setup it prints "fits" or "does not fit" at the S asked, the longest S that
fits, and an estimated step time. The device memory a plan keeps free: --cuda-context (1 GiB:
the CUDA context, cuBLAS workspaces and loaded kernels) plus --fragmentation (5% of the
device: the caching allocator's reserved-but-unused blocks); the H100 capacity search in
bench/results/gpu_h100_2026-11-24/ bracketed the real figure between 2.0 and 9.0 GiB on an
80 GB card. An H100 "80GB" has 81559MiB (79.6 GiB). Step times (seconds per step, tokens per
second, at --seq and at the longest S) are ESTIMATES: FLOPs (matmuls and attention, forward,
backward, recompute) at the rates of --throughputs FILE (ckpt_ext.throughputs; by sequence
length), by default the plan's H100 rates: attention forward 350 and backward 170 TFLOP/s (the
Triton attention kernels ran 329-372 and 151-180) and matmuls 400 (the LM head's GEMMs ran
about 410); --attention-fwd-tflops etc. replace one rate (--attention-bwd-tflops the strict
one too). A second line gives the step times under torch.use_deterministic_algorithms(True),
the attention backward at the file's strict rate (the Triton backward the H100 rates measured
is deterministic: the same). Memory-bound work and the optimizer step are left out. On the
H100 they came to 0.83-1.03x the measured LLaMA-3.1-8B LoRA steps.

examples:
  python -m ckpt_ext.plan meta-llama/Llama-3.1-8B --batch 1 --seq 131072 \\
      --device-memory 80GiB --weights lora --offload --host-memory 200GiB
  python -m ckpt_ext.plan config.json --batch 1 --seq 8192 --device-memory 80GiB --shard 8
"""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m ckpt_ext.plan", epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Saved-activation bytes of each ckpt_ext preset, recompute FLOPs, the LM "
                    "head with and without the fused loss, the step's peak memory, whether a "
                    "step fits a device, and the 'auto' choice for a budget.")
    ap.add_argument("config", nargs="?",
                    help="an HF config.json, a model directory, or a model id in the local "
                         "Hugging Face cache (e.g. meta-llama/Llama-3.1-8B; nothing is "
                         "downloaded); or give the dimensions below")
    dim = _positive_int
    ap.add_argument("--hidden-size", type=dim)
    ap.add_argument("--heads", type=dim, help="num_attention_heads")
    ap.add_argument("--kv-heads", type=dim, help="num_key_value_heads (default: --heads)")
    ap.add_argument("--head-dim", type=dim, help="default hidden_size // heads")
    ap.add_argument("--intermediate-size", type=dim)
    ap.add_argument("--layers", type=_bounded_int(_MAX["layers"]), help="num_hidden_layers")
    ap.add_argument("--router-logits", action=argparse.BooleanOptionalAction, default=None,
                    help="an MoE model returns its router logits for the load-balancing loss "
                         "(default: the config's output_router_logits): (tokens, experts) a "
                         "layer and HF's softmax of them, kept through the step")
    ap.add_argument("--router-aux-loss", choices=("exact", "fused"), default="exact",
                    help="with router logits on: 'exact' (default) keeps every MoE layer's "
                         "logits as above; 'fused' (patch_llama(router_aux_loss='fused')) "
                         "keeps only each layer's (3, experts) float32 statistics of the loss")
    ap.add_argument("--expert-lora-rank", type=_bounded_int(1 << 16), default=0,
                    help="with --weights lora: LoRA rank on the routed experts too (PEFT's "
                         "target_parameters; their state and, in the step times, their "
                         "GEMMs); 0 (default): attention and shared experts only")
    ap.add_argument("--vocab-size", type=_bounded_int(_MAX["vocab"]))
    ap.add_argument("--batch", type=_bounded_int(_MAX["batch"]), required=True,
                    help="sequences per step on one GPU")
    ap.add_argument("--seq", type=_bounded_int(_MAX["seq"]), required=True,
                    help="tokens per sequence, S")
    ap.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    ap.add_argument("--budget", help="bytes for the decoder layers' saved activations, e.g. "
                                     "20GiB or 512MB: prints the 'auto' choice")
    ap.add_argument("--device-memory", help="one GPU's memory, e.g. 80GiB or 81559MiB: prints "
                                            "per setup whether the step fits at --seq, and the "
                                            "longest S that fits")
    ap.add_argument("--weights", choices=("full", "lora", "qlora"), default="full",
                    help=_WEIGHTS_HELP)
    ap.add_argument("--quant", choices=QUANTS, default="nf4",
                    help="with --weights qlora: bitsandbytes' quantization of the base "
                         "projections (default nf4; nf4 and fp4 with double quantization "
                         "unless --no-double-quant)")
    ap.add_argument("--no-double-quant", action="store_true",
                    help="with --weights qlora and a 4-bit --quant: fp32 block scales "
                         "(bnb_4bit_use_double_quant=False)")
    ap.add_argument("--shard", type=_bounded_int(_MAX["shard"]), default=1,
                    help="with --device-memory: the sharding degree of FSDP / ZeRO-3 (default "
                         "1: none): the model state per GPU is 1/N of it plus two gathered "
                         "units (a layer or the head) in --dtype")
    ap.add_argument("--path", choices=_PATHS, default="cuda",
                    help="whose transients the peak model counts: the Triton kernels (cuda) or "
                         "the ATen kernels (cpu)")
    ap.add_argument("--offload", action="store_true",
                    help="also plan each fused preset with offload='cpu' (saved layer tensors "
                         "in host memory): device peak, host bytes, fits or not")
    ap.add_argument("--host-memory", help="with --offload: host memory for one GPU's saved "
                                          "tensors (offload_limit), e.g. 200GiB; default this "
                                          "machine's RAM / --gpus-per-node")
    ap.add_argument("--offload-stream", action="store_true",
                    help="with --offload: also plan min_memory with streamed inputs "
                         "(patch_llama(..., offload='cpu', offload_stream=True)): a layer's "
                         "input stays in host memory through the backward, which copies it to "
                         "the device a token chunk at a time (no prefetch pool; with segments "
                         "the rebuilt inputs go to host memory too); the copies are serialized "
                         "with compute and added to the step times at --host-link-gbytes-per-s "
                         "(ckpt_ext.plan.offload_step_peak(..., stream=True))")
    ap.add_argument("--segment-layers", type=_segment_layers, default=1, metavar="K|auto",
                    help="min_memory in segments of K consecutive layers "
                         "(patch_llama(policy='min_memory', segment_layers=K)): each segment "
                         "keeps its first layer's input only (on the device or, with --offload, "
                         "in host memory: 1/K of the layers' inputs), and its backward runs its "
                         "first K-1 layers forward once more to rebuild the others' inputs, "
                         "held on the device beside the top layer's backward; adds 'min_memory "
                         "in K-layer segments' rows with their step times (the extra forward "
                         "counted). 'auto' (with --device-memory): the K of least estimated "
                         "time that fits at --seq (ckpt_ext.plan.choose_segment_layers), and "
                         "the longest S over every K. Default 1: one layer a segment, as today")
    ap.add_argument("--gpus-per-node", type=_bounded_int(_MAX["gpus"]), default=1,
                    help="with --offload, without --host-memory: GPUs sharing one host's RAM "
                         "(default 1): divides the default --host-memory")
    ap.add_argument("--host-link-gbytes-per-s", type=_positive_float,
                    default=HOST_LINK_GBYTES_PER_S, metavar="GB_S",
                    help="with --offload and --device-memory: the host link's rate per GPU and "
                         "direction in GB/s for 'auto' with offload, chosen by time, and the "
                         "streamed rows' copies (default 25: an assumption; PCIe Gen5 x16 "
                         "peaks at 64)")
    ap.add_argument("--cuda-context", default="1GiB",
                    help="with --device-memory: device memory kept for the CUDA context "
                         "(default 1GiB)")
    ap.add_argument("--fragmentation", type=_fraction, default=FRAGMENTATION,
                    help="with --device-memory: fraction of the device memory kept for the "
                         "allocator's fragmentation (default 0.05)")
    ap.add_argument("--sequence-parallel", type=_bounded_int(_MAX["gpus"]), default=1,
                    metavar="N",
                    help="Ulysses sequence parallelism over N GPUs (default 1: none): each GPU "
                         "holds S/N tokens of every layer and attends over all S with Hq/N "
                         "heads after an all-to-all of q, k, v; prints per GPU the saved bytes, "
                         "peak, all-to-all bytes per layer, host bytes (--offload), the longest "
                         "S (with --device-memory) and the step time. --seq is the whole "
                         "sequence (a multiple of N); --shard M shards the model state")
    ap.add_argument("--link-gbytes-per-s", type=_positive_float, default=SP_LINK_GBYTES_PER_S,
                    metavar="GB_S",
                    help="with --sequence-parallel: all-to-all bandwidth per GPU and direction "
                         "in GB/s (1e9 bytes/s) for the step time (default 300: an assumption "
                         "for NVLink-class links, whose H100 NVLink 4 peak is 450 GB/s a "
                         "direction; about 25-50 for 200-400 Gbit/s InfiniBand between nodes)")
    ap.add_argument("--throughputs", metavar="FILE",
                    help="with --device-memory or --sequence-parallel (the step times): a kernel "
                         "throughputs file (ckpt_ext.throughputs: JSON with TFLOP/s per "
                         "kind, attention_forward / attention_backward / matmul, by sequence "
                         "length) for the step time estimate; default the plan's H100 rates "
                         "(ckpt_ext.throughputs.default_throughputs)")
    ap.add_argument("--attention-fwd-tflops", type=_positive_float, default=None,
                    help="attention forward rate (below 1e9 TFLOP/s, as a file's) for the step "
                         "time estimate, in place of the throughputs file's (default: its rate; "
                         "the plan's own is 350, the Triton kernel on an H100)")
    ap.add_argument("--attention-bwd-tflops", type=_positive_float, default=None,
                    help="attention backward rate, in place of the file's (the plan's own: "
                         "170, the Triton kernel on an H100)")
    ap.add_argument("--matmul-tflops", type=_positive_float, default=None,
                    help="matmul rate, in place of the file's (the plan's own: 400, an H100)")
    return ap


def _times(args) -> bool:
    """Whether the plan prints step times: the verdict's and the sequence-parallel table's."""
    return args.device_memory is not None or args.sequence_parallel > 1


# Flags that apply only with another: (the flags' dests, what they need in words, whether the
# arguments have it). Given without it, a flag is a usage error naming both; not given, it
# takes its default.
_NEEDS = (
    (("host_memory", "offload_stream"), "--offload", lambda a: a.offload),
    (("gpus_per_node",), "--offload and without --host-memory (it divides the default host "
                         "memory)", lambda a: a.offload and a.host_memory is None),
    (("host_link_gbytes_per_s",), "--offload and --device-memory (auto + offload's choice)",
     lambda a: a.offload and a.device_memory is not None),
    (("link_gbytes_per_s",), "--sequence-parallel N > 1", lambda a: a.sequence_parallel > 1),
    (("shard", "cuda_context", "fragmentation"), "--device-memory",
     lambda a: a.device_memory is not None),
    (("expert_lora_rank",), "--weights lora", lambda a: a.weights == "lora"),
    (("quant",), "--weights qlora", lambda a: a.weights == "qlora"),
    (("no_double_quant",), "--weights qlora and a 4-bit --quant",
     lambda a: a.weights == "qlora" and a.quant != "int8"),
    (("throughputs", "attention_fwd_tflops", "attention_bwd_tflops", "matmul_tflops"),
     "--device-memory or --sequence-parallel N > 1 (the step times)", _times))
_UNSET = object()


def _parse_args(ap: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """``ap.parse_args(argv)``, with a usage error for a flag of :data:`_NEEDS` given without
    what it needs."""
    dests = [dest for group, _, _ in _NEEDS for dest in group]
    args = ap.parse_args(argv, argparse.Namespace(**dict.fromkeys(dests, _UNSET)))
    given = {dest for dest in dests if getattr(args, dest) is not _UNSET}
    for dest in dests:
        if dest not in given:
            setattr(args, dest, ap.get_default(dest))
    for group, words, ok in _NEEDS:
        for dest in group:
            if dest in given and not ok(args):
                ap.error(f"argument --{dest.replace('_', '-')}: applies only with {words}")
    return args


def _router_note(d) -> str:
    """What an MoE layer keeps for the load-balancing loss, in words."""
    if not d.router_logits:
        return "not returned"
    if d.router_aux_loss == "fused":
        return "fused aux loss: (3, experts) statistics a layer, no (tokens, experts) logits"
    return "kept (output_router_logits)"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = _parser()
    args = _parse_args(ap, argv)
    for name in ("budget", "device_memory", "host_memory", "cuda_context"):
        if getattr(args, name) is not None:
            flag = f"argument --{name.replace('_', '-')}"
            try:
                value = parse_bytes(getattr(args, name), flag)
            except (TypeError, ValueError) as e:
                ap.error(str(e))
            if value > _MAX_BYTES:
                ap.error(f"{flag}: must be at most 1 EiB ({_MAX_BYTES:,} bytes), got "
                         f"{getattr(args, name)!r}")
            setattr(args, name, value)

    try:
        args.rates = (load_throughputs(args.throughputs) if args.throughputs is not None
                      else default_throughputs())
    except ValueError as e:
        ap.error(f"argument --throughputs: {e}")
    too_fast = [r for r in args.rates.rates if not r.tflops < _MAX_RATE]
    if too_fast:
        ap.error(f"argument --throughputs: {args.rates.source}: a {too_fast[0].kind} rate of "
                 f"{too_fast[0].tflops:g} TFLOP/s; rates must be below {_MAX_RATE:g}")
    if args.offload:
        try:
            _host_memory(args)
        except ValueError as e:
            ap.error(str(e))
    try:
        config = _read_config(args.config) if args.config else {}
    except ValueError as e:
        ap.error(f"argument config: {e}")
    for key, arg in (("hidden_size", "hidden_size"), ("num_attention_heads", "heads"),
                     ("num_key_value_heads", "kv_heads"), ("head_dim", "head_dim"),
                     ("intermediate_size", "intermediate_size"),
                     ("num_hidden_layers", "layers"), ("vocab_size", "vocab_size")):
        if getattr(args, arg) is not None:
            config[key] = getattr(args, arg)
    try:
        layers = layer_dims_from_config(config)
    except NotImplementedError as e:
        ap.error(str(e))
    except ValueError as e:
        ap.error(f"{e} (give a config.json or --hidden-size/--heads/--intermediate-size/"
                 f"--layers)")
    if args.router_logits is not None:
        if args.router_logits and not any(x.moe for x in layers):
            ap.error("argument --router-logits: the config has no experts")
        layers = [dataclasses.replace(x, router_logits=args.router_logits) if x.moe else x
                  for x in layers]
    if args.router_aux_loss == "fused":
        if not any(x.moe and x.router_logits for x in layers):
            ap.error("argument --router-aux-loss: 'fused' applies to a config with experts and "
                     "router logits on (output_router_logits, or --router-logits)")
        layers = [dataclasses.replace(x, router_aux_loss="fused") if x.moe else x
                  for x in layers]
    if args.expert_lora_rank and not any(x.moe for x in layers):
        ap.error("argument --expert-lora-rank: applies only to a config with experts")
    if args.weights == "qlora":
        if any(x.moe for x in layers):
            ap.error("argument --weights: 'qlora' plans dense layers (bitsandbytes does not "
                     "quantize HF's fused expert weights)")
        if args.shard > 1 or args.sequence_parallel > 1:
            ap.error("argument --weights: 'qlora' runs on one device or under DDP: the fused "
                     "layers refuse sharded quantized weights (--shard) and the plan has no "
                     "QLoRA sequence-parallel model (--sequence-parallel)")
    if args.offload_stream and args.sequence_parallel > 1:
        ap.error("argument --offload-stream: applies only without --sequence-parallel (the "
                 "sequence-parallel backward reads its layer inputs whole)")
    if args.segment_layers == "auto" and args.device_memory is None:
        ap.error("argument --segment-layers: 'auto' chooses K by the step's fit and time: give "
                 "--device-memory")
    if args.segment_layers != "auto" and args.segment_layers > len(layers):
        ap.error(f"argument --segment-layers: must be at most the layer count, {len(layers)}, "
                 f"got {args.segment_layers}")
    if "vocab_size" not in config:
        ap.error("missing vocab_size (in the config or --vocab-size)")
    V = config["vocab_size"]
    if isinstance(V, bool) or not isinstance(V, int) or V < 1:
        ap.error(f"vocab_size must be a positive int (in the config or --vocab-size), got {V!r}")
    for name, value, limit in (("hidden_size", layers[0].hidden_size, _MAX["dim"]),
                               ("intermediate_size", layers[0].intermediate_size, _MAX["dim"]),
                               ("num_attention_heads", layers[0].num_heads, _MAX["dim"]),
                               ("head_dim", layers[0].head_dim, _MAX["dim"]),
                               ("num_hidden_layers", len(layers), _MAX["layers"]),
                               ("vocab_size", V, _MAX["vocab"])):
        if value > limit:
            ap.error(f"config: {name} must be at most {limit:,}, got {value:,}")
    B, S, dtype = args.batch, args.seq, _DTYPES[args.dtype]
    if args.sequence_parallel > 1:
        try:
            sp_exchange_bytes("fast", layers[0], B, S, args.sequence_parallel, dtype)
            for x in layers:
                sp_exchange_bytes("fast", x, 1, args.sequence_parallel, args.sequence_parallel,
                                  dtype)
        except (ValueError, NotImplementedError) as e:   # not implemented: router logits
            ap.error(f"argument --sequence-parallel: {e}")
    d = layers[0]
    L, T = len(layers), B * S
    head_hf = head_saved_bytes(B, S, d.hidden_size, V, dtype, fused=False)
    head_fused = head_saved_bytes(B, S, d.hidden_size, V, dtype, fused=True)
    print(f"{L} layers, H {d.hidden_size}, heads {d.num_heads}/{d.num_kv_heads}, head_dim "
          f"{d.head_dim}, I {d.intermediate_size}, V {V}; B {B}, S {S:,} ({T:,} tokens), "
          f"{str(dtype).replace('torch.', '')}")
    moe = [x for x in layers if x.moe]
    if moe:
        m = moe[0]
        print(f"mixture of experts: {len(moe)} of {L} layers, {m.experts} experts of I "
              f"{m.expert_intermediate_size}, top-k {m.top_k}, shared expert I "
              f"{m.intermediate_size or 'none'}; router logits "
              f"{_router_note(m)}"
              + (f"; expert LoRA r {args.expert_lora_rank}" if args.expert_lora_rank else "")
              + "; HF checkpointing's step is not modelled for experts (bench/moe.py measures "
              "it)")
    rows = []
    for preset in ("fast", "balanced", "min_memory", "torch"):
        ptb = sum(per_token_bytes(preset, dtype=dtype, **x.kwargs()) for x in layers)
        model = B * S * ptb
        flops = sum(recompute_flops(preset, x, B, S, **_lora_kwargs(args)) for x in layers)
        rows.append([preset, f"{ptb // L:,}", format_bytes(model // L), format_bytes(model),
                     format_bytes(model + head_hf), format_bytes(model + head_fused),
                     _tflop(flops // L), _tflop(flops)])
    print(_table(rows, ["preset", "B/token/layer", "per layer", "layers", "+ HF head",
                        "+ fused head", "recompute TFLOP/layer", "recompute TFLOP"]))
    e = dtype.itemsize
    print(f"LM head + loss, saved for backward: HF {format_bytes(head_hf)} (per token: hidden "
          f"{e}*H + fp32 log-softmax 4*V + labels 8 = {e * d.hidden_size + 4 * V + 8:,} B; "
          f"it also returns the {T:,} x {V:,} logits, {format_bytes(T * V * e)}); fused "
          f"{format_bytes(head_fused)} (hidden + labels + fp32 lse = "
          f"{e * d.hidden_size + 12:,} B/token)")
    print("recompute: forward FLOPs redone in backward (matmuls only; see ckpt_ext.plan); "
          "'auto' chooses among these presets and HF's own layer ('none') by the time model")
    print()
    args.segments = _resolve_segments(args, layers, V, B, S, dtype)
    args.stream_segments = (_resolve_segments(args, layers, V, B, S, dtype, stream=True)
                            if args.offload_stream else None)
    _print_steps(args, layers, V, B, S, dtype)
    if args.offload:
        print()
        _print_offload(args, layers, V, B, S, dtype)
    if args.device_memory is not None:
        print()
        _print_verdict(args, layers, V, B, S, dtype)
    if args.sequence_parallel > 1:
        print()
        _print_sequence_parallel(args, layers, V, B, S, dtype)
    if args.budget is not None:
        print()
        try:
            choice = _auto_choice(args, layers, V, B, S, dtype, budget=args.budget)
        except ValueError as err:
            print(f"{err}", file=sys.stderr)
            return 2
        chosen = list(choice.presets)
        flops = sum(recompute_flops(p, x, B, S, **_lora_kwargs(args))
                    for p, x in zip(chosen, layers) if p != "none")
        print(f"auto for a budget of {format_bytes(args.budget)}: {_counts(chosen)}; "
              f"layers keep {format_bytes(choice.saved)} "
              f"({format_bytes(choice.saved + head_fused)} with the fused head), recompute "
              f"{_tflop(flops)} TFLOP; the layers' step about {choice.seconds:,.3f} s")
        _print_auto_layers(args, choice, layers, B, S, dtype)
    return 0


def _counts(chosen) -> str:
    return ", ".join(f"{chosen.count(p)} x {p}" for p in AUTO_CHOICES if p in chosen)


def _auto_choice(args, layers, V, B, S, dtype, *, room=None, budget=None):
    """patch_llama(policy="auto")'s choice (ckpt_ext.plan.choose_auto) at the CLI's rates and
    the throughputs file's overheads."""
    if budget is not None and args.weights == "qlora":  # one layer's dequantized weights
        budget = parse_bytes(budget) - dequantized_bytes(layers, dtype)
    return choose_auto(layers, V, B, S, dtype, room=room, budget=budget, path=args.path,
                       train_weights=args.weights == "full", **_lora_kwargs(args),
                       quantized_base=args.weights == "qlora",
                       overheads=args.rates.overheads, throughputs=_throughputs(args),
                       **_rate_kwargs(args, S))


def _throughputs(args):
    """The throughputs file's rates (by sequence length and query-chunk rows), each kind a
    --*-tflops flag gives replaced by the flag's rate everywhere: what the chunk rule reads."""
    from .throughputs import Rate
    kinds = {"attention_fwd_tflops": "attention_forward",
             "attention_bwd_tflops": "attention_backward", "matmul_tflops": "matmul"}
    given = tuple(Rate(kind, float(getattr(args, key)), source="flag")
                  for key, kind in kinds.items() if getattr(args, key) is not None)
    return dataclasses.replace(args.rates, rates=given + args.rates.rates) if given \
        else args.rates


def _chunk_words(n: int, rows) -> str:
    if rows is None:
        return f"x{n} chunk{'s' if n > 1 else ''} (the cap's rows)"
    return f"x{n} chunk{'s' if n > 1 else ''} of {rows:,} rows"


def _print_auto_layers(args, choice, layers, B, S, dtype) -> None:
    """Each layer's choice, its token chunks (the chunk rule's rows) and its time in the
    model."""
    cells = [f"{i}: {p} " + (_chunk_words(n, r) if p not in ("none", "torch") else "x1") +
             f" {t * 1e3:,.1f} ms"
             for i, (p, n, r, t) in enumerate(zip(choice.presets, choice.chunks,
                                                   choice.rows or [None] * len(layers),
                                                   choice.layer_seconds))]
    print("per layer (preset, token chunks, time in the model): " + "; ".join(cells))


def _spans(values) -> list:
    """[(first, last, value)] of the runs of equal consecutive values."""
    out = []
    for i, v in enumerate(values):
        if out and out[-1][2] == v:
            out[-1] = (out[-1][0], i, v)
        else:
            out.append((i, i, v))
    return out


def _print_chunk_rule(args, layers, V, B, S, dtype, room: int) -> None:
    """The chunk rule (ckpt_ext.plan.choose_chunk_rows) for each fused preset within the
    room for the step: each layer's token chunks and its time in the model, beside the cap's."""
    from .config import chunk_bytes_pinned
    if chunk_bytes_pinned():
        print("chunk rows: CKPT_EXT_CHUNK_BYTES is pinned, so the fused layers chunk by the "
              "cap (the rule of ckpt_ext.plan.choose_chunk_rows is off)")
        return
    kw = dict(path=args.path, train_weights=args.weights == "full",
              quantized_base=args.weights == "qlora", throughputs=_throughputs(args),
              **_lora_kwargs(args))
    print(f"chunk rows by time (ckpt_ext.plan.choose_chunk_rows, patch_llama's rule when no "
          f"chunk_bytes is pinned): one chunk when the step fits the "
          f"{format_bytes(room)} left for it, else the fastest chunk count that fits; "
          f"per layer (chunks, time in the model):")
    for preset in FUSED_PRESETS:
        c = choose_chunk_rows(preset, layers, V, B, S, dtype, room=room, **kw)
        cells = "; ".join(
            (f"layer {a}" if a == b else f"layers {a}-{b}") + f": {c.chunks} chunk"
            f"{'s' if c.chunks > 1 else ''} of {c.rows:,} rows, {t * 1e3:,.1f} ms"
            + ("" if a == b else " each")
            for a, b, t in _spans([round(t, 12) for t in c.layer_seconds]))
        tail = (f"step peak {format_bytes(c.peak)}" if c.fits else
                f"nothing fits: the cap's {c.cap_rows:,} rows, step peak {format_bytes(c.peak)}")
        print(f"  {preset}: {cells}; {tail}")


def _setups(layers) -> tuple:
    """The step setups the plan models: HF checkpointing's re-run layer for dense layers only."""
    if any(x.moe for x in layers):
        return tuple(s for s in PEAK_SETUPS if not s.startswith("hf_gc"))
    return PEAK_SETUPS


_SETUP_NAMES = {"hf_gc": "HF checkpointing, HF head", "hf_gc+fused": "HF checkpointing, fused loss",
                "fast": "fast", "balanced": "balanced", "min_memory": "min_memory"}


def _weights_words(args) -> str:
    words = {"full": "full fine-tune", "lora": "LoRA"}.get(args.weights)
    if words is None:
        words = "QLoRA " + args.quant + (", double quant" if args.quant != "int8"
                                          and not args.no_double_quant else "")
    return words + (f", sharded {args.shard} ways" if args.shard > 1 else "")


def _print_steps(args, layers, V, B, S, dtype) -> None:
    """The step table: saved bytes and peak per setup."""
    train = args.weights == "full"
    header = [f"step ({_weights_words(args)}, {args.path} path)", "saved", "peak",
              "peak KiB/token", "peak is in"]
    rows = []
    for setup in _setups(layers):
        p = step_peak(setup, layers, V, B, S, dtype, path=args.path, train_weights=train,
                      quantized_base=args.weights == "qlora")
        rows.append([_SETUP_NAMES[setup], format_bytes(p.saved), format_bytes(p.peak),
                     f"{p.peak / (B * S) / 1024:,.1f}", p.phase])
    k = _segments(args)
    if k > 1:
        p = step_peak("min_memory", layers, V, B, S, dtype, path=args.path, train_weights=train,
                      quantized_base=args.weights == "qlora", segment_layers=k)
        rows.append([_segment_name(k), format_bytes(p.saved), format_bytes(p.peak),
                     f"{p.peak / (B * S) / 1024:,.1f}", p.phase])
    print(_table(rows, header))
    print("peak: the most a training step allocates at once above its start, gradients of an "
          "earlier step present (ckpt_ext.plan.step_peak); the fused presets use the fused "
          "head and final norm")


def _host_memory(args):
    """(host bytes for one GPU's offloaded tensors, how it was chosen)."""
    if args.host_memory is not None:
        return args.host_memory, "--host-memory"
    ram = host_ram_bytes()
    if ram is None:
        raise ValueError("argument --host-memory: this OS does not report its RAM; give "
                         "--host-memory (offload never assumes unlimited host memory)")
    return ram // args.gpus_per_node, (f"this machine's RAM {format_bytes(ram)} / "
                                       f"--gpus-per-node {args.gpus_per_node}; give "
                                       f"--host-memory for the training host's")


def _print_offload(args, layers, V, B, S, dtype) -> None:
    """The offload table: device peak, host bytes and copy volume per fused preset."""
    train = args.weights == "full"
    host, how = _host_memory(args)
    print(f"host memory for offloaded tensors: "
          f"{format_bytes(host) if host is not None else 'no cap'} ({how})")
    header = [f"offload='cpu' ({_weights_words(args)}, {args.path} path)", "device peak",
              "of it the prefetch pool", "host bytes", "layers in host", "kept on device"]
    rows = []
    for setup in OFFLOAD_SETUPS:
        p = offload_step_peak(setup, layers, V, B, S, dtype, path=args.path, train_weights=train,
                              host_limit=host, quantized_base=args.weights == "qlora")
        rows.append([setup, format_bytes(p.peak), format_bytes(p.pool), format_bytes(p.host),
                     f"{p.offloaded}/{len(layers)}", format_bytes(p.kept)])
    k = _segments(args)
    if k > 1:
        p = offload_step_peak("min_memory", layers, V, B, S, dtype, path=args.path,
                              train_weights=train, host_limit=host,
                              quantized_base=args.weights == "qlora", segment_layers=k)
        rows.append([_segment_name(k), format_bytes(p.peak), format_bytes(p.pool),
                     format_bytes(p.host), f"{p.offloaded}/{p.calls} segments",
                     format_bytes(p.kept)])
    streamed = []
    if args.offload_stream:
        for ks in sorted({1, _stream_segments(args)}):
            q = offload_step_peak("min_memory", layers, V, B, S, dtype, path=args.path,
                                  train_weights=train, host_limit=host,
                                  quantized_base=args.weights == "qlora", segment_layers=ks,
                                  stream=True)
            streamed.append((ks, q))
            rows.append([_stream_name(ks), format_bytes(q.peak), format_bytes(q.pool),
                         format_bytes(q.host_peak),
                         f"{q.offloaded}/{q.calls}" + (" segments" if ks > 1 else ""),
                         format_bytes(q.kept + q.rebuilt)])
    print(_table(rows, header))
    print("offload: each fused layer's saved tensors go to host memory in forward and come back "
          "one layer ahead in backward; the device keeps a pool of two layers' worth; past the "
          "host memory the remaining layers keep theirs on the device")
    if k > 1:
        print(f"segments of {k}: each segment's first input goes to host memory, the pool holds "
              f"two segments' inputs, and a segment's backward holds its {k - 1} rebuilt "
              f"layer input{'s' if k > 2 else ''} on the device ({format_bytes(p.rebuilt)} "
              f"here) beside the top layer's backward")
    for ks, q in streamed:
        first = f"first {ks - 1} layers" if ks > 2 else "first layer"
        seg = (f"; segments of {ks}: the rebuild replays each segment's {first} forward from "
               f"a device copy of its input and sends "
               f"each rebuilt input to host memory (host bytes: the most at once, "
               f"{format_bytes(q.host_rebuilt)} of them rebuilt; past the host memory they stay "
               f"on the device, in 'kept on device'), the rebuild a device phase of its own "
               f"({format_bytes(q.rebuild)} here)" if ks > 1 else "")
        print(f"{_stream_name(ks)}: the input stays in host memory through the backward, "
              f"which copies it to the device one token chunk at a time: no prefetch pool"
              f"{seg}; {format_bytes(q.copies)} copied serialized with compute a step "
              f"(ckpt_ext.plan.offload_step_peak(..., stream=True))")


def _longest_text(n: int, limit: int = 1 << 26) -> str:
    if n == 0:
        return "none"
    return f">= {n:,}" if n >= limit else f"{n:,}"


def _print_verdict(args, layers, V, B, S, dtype) -> None:
    """Fits / does not fit per setup at the S asked, the longest S, the step time estimate."""
    train = args.weights == "full"
    memory = args.device_memory
    headroom = headroom_bytes(memory, args.cuda_context, args.fragmentation)
    usable = memory - headroom
    state = _model_state(args, layers, V, dtype)
    room = usable - state
    print(f"will it fit: {_weights_words(args)}, B {B}, S {S:,}, {args.path} path, on "
          f"{format_bytes(memory)} of device memory")
    print(f"  kept free: CUDA context {format_bytes(args.cuda_context)} + allocator "
          f"fragmentation {args.fragmentation:.0%} of the device "
          f"({format_bytes(int(args.fragmentation * memory))}) = {format_bytes(headroom)}; "
          f"usable {format_bytes(usable)}")
    whole = _model_state(args, layers, V, dtype, shard=1)
    if args.shard > 1:
        print(f"  model state per GPU ({args.weights}): {format_bytes(state)} = 1/{args.shard} "
              f"of {format_bytes(whole)} + two gathered units in {args.dtype} "
              f"({format_bytes(state - -(-whole // args.shard))})")
    else:
        print(f"  model state ({args.weights}): {format_bytes(state)}")
    print(f"  left for the step: {format_bytes(room) if room > 0 else 'nothing'}")
    host = _host_memory(args)[0] if args.offload else None
    k = _segments(args)
    cases = [(setup, False, 1) for setup in _setups(layers)]
    if args.offload:
        cases += [(setup, True, 1) for setup in OFFLOAD_SETUPS]
    if k > 1:
        cases += [("min_memory", False, k)] + ([("min_memory", True, k)] if args.offload else [])
    streams = ([("min_memory", True, ks, True) for ks in sorted({1, _stream_segments(args)})]
               if args.offload_stream else [])
    rows = []
    for setup, offload, seg, stream in [c + (False,) for c in cases] + streams:
        if offload:
            peak = offload_step_peak(setup, layers, V, B, S, dtype, path=args.path,
                                     train_weights=train, host_limit=host,
                                     quantized_base=args.weights == "qlora",
                                     segment_layers=seg, stream=stream).peak
        else:
            peak = step_peak(setup, layers, V, B, S, dtype, path=args.path,
                             train_weights=train, quantized_base=args.weights == "qlora",
                             segment_layers=seg).peak
        total = state + peak + headroom
        if room <= 0:
            verdict, n = "does not fit (model state)", 0
        else:
            verdict = "fits" if peak <= room else "does not fit"
            kw = dict(path=args.path, headroom=headroom, shard=args.shard,
                      expert_lora_rank=args.expert_lora_rank, segment_layers=seg,
                      **_quant_kwargs(args))
            n = (longest_sequence_offload(setup, layers, V, B, dtype, memory, host,
                                          args.weights, stream=stream, **kw) if offload else
                 longest_sequence(setup, layers, V, B, dtype, memory, args.weights, **kw))
        longest = _longest_text(n)

        def timed(s):
            return (_stream_seconds(args, layers, V, B, s, dtype, seg, host) if stream else
                    _seconds(args, setup, layers, V, B, s, segment_layers=seg))
        secs = timed(S)
        name = _SETUP_NAMES[setup] if seg == 1 else _segment_name(seg)
        row = [_stream_name(seg) if stream else name + (" + offload" if offload else ""),
               format_bytes(peak), format_bytes(total), verdict, f"{secs:,.2f}",
               f"{B * S / secs:,.0f}", longest]
        if n:
            secs_n = timed(n)
            row += [f"{secs_n:,.2f}", f"{B * n / secs_n:,.0f}"]
        else:
            row += ["-", "-"]
        rows.append(row)
    print(_table(rows, ["setup", "step peak", "state + peak + kept free", f"at S {S:,}",
                        "step s", "tokens/s", "longest S", "its step s", "its tokens/s"]))
    if room > 0:
        _print_chunk_rule(args, layers, V, B, S, dtype, room)
        try:
            choice = _auto_choice(args, layers, V, B, S, dtype, room=room)
            print(f"auto (patch_llama(policy='auto'), no activation_budget: the room left for "
                  f"the step): {_counts(list(choice.presets))}; step peak "
                  f"{format_bytes(choice.peak)}, the layers' step about "
                  f"{choice.seconds:,.3f} s (FLOPs, chunk sums and launches: "
                  "ckpt_ext.plan.layer_seconds)")
            _print_auto_layers(args, choice, layers, B, S, dtype)
        except ValueError as err:
            print(f"  {err}")
    if args.offload:
        _print_auto_offload(args, layers, V, B, S, dtype, room, host, state + headroom)
    if args.segment_layers == "auto" and args.sequence_parallel == 1:
        _print_auto_segments(args, layers, V, B, S, dtype, room, host, headroom)
        if args.offload_stream:
            _print_auto_segments(args, layers, V, B, S, dtype, room, host, headroom, True)
    if room <= 0:
        print(f"does not fit: the model state, {format_bytes(state)}, > the usable device "
              f"memory, {format_bytes(usable)} ({format_bytes(memory)} less "
              f"{format_bytes(headroom)} kept free)"
              + ("; a full fine-tune keeps 16 B a parameter" if args.weights == "full" else ""))
        need = (_smallest_shard(layers, V, B, S, dtype, args, headroom)
                if args.weights != "qlora" else 0)
        if need:
            print(f"  sharded (--shard N, FSDP / ZeRO-3): min_memory fits S {S:,} from --shard "
                  f"{need}, where the state is "
                  f"{format_bytes(_model_state(args, layers, V, dtype, shard=need))}"
                  f" per GPU; rerun with --shard {need} for the per-GPU figures")
        else:
            print("  no sharding degree up to 4096 makes room: the gathered units alone are "
                  "too large")
    print(f"step s, tokens/s: an ESTIMATE from FLOPs (forward, backward, recompute; "
          f"ckpt_ext.plan.step_flops) at {_rates_words(args, S)}; norms, SwiGLU, the optimizer"
          + (", the offload copies" if args.offload else "")
          + " and launch gaps are left out (the H100 rates came to 0.83-1.03x the measured "
          "LLaMA-3.1-8B LoRA steps at S 8K-16K)"
          + (f"; the streamed rows add their copies serialized with compute at "
             f"{args.host_link_gbytes_per_s:g} GB/s (ckpt_ext.plan.stream_copy_bytes; the "
             f"forward's copies to host memory overlap compute and are left out)"
             if args.offload_stream else ""))
    _print_strict(args, [setup for setup, offload, seg in cases if not offload and seg == 1],
                  layers, V, B, S)


def _print_strict(args, setups, layers, V, B, S) -> None:
    """The step times under torch.use_deterministic_algorithms(True): attention_dq "auto"
    then runs deterministic attention backwards only, at the throughputs' strict rate."""
    default, strict = (_rate_kwargs(args, S, s)["attention_bwd_tflops"] for s in (False, True))
    words = "step s under torch.use_deterministic_algorithms(True) (deterministic attention " \
            "backwards only"
    if strict == default:
        print(f"{words}): the same, the strict backward's rate being the default's, "
              f"{default:g} TFLOP/s"
              + ("" if args.rates.has_strict else " (these rates hold no other)"))
        return
    times = "; ".join(f"{_SETUP_NAMES[setup]} "
                      f"{_seconds(args, setup, layers, V, B, S, strict=True):,.2f}"
                      for setup in setups)
    print(f"{words}, at {strict:g} TFLOP/s against {default:g} by default at S {S:,}): "
          f"{times}")


def _print_auto_offload(args, layers, V, B, S, dtype, room, host, outside) -> None:
    """policy='auto' with offload, chosen by time (ckpt_ext.plan.choose_presets_offload): fits
    or does not fit at S as the verdict's rows say it (the device peak within ``room``, the
    device less ``outside``: the model state and the memory kept free)."""
    where = f"auto + offload, by time, at S {S:,}:"
    if room <= 0:
        print(f"{where} does not fit (model state)")
        return
    try:
        c = choose_presets_offload(layers, V, B, S, dtype, room, host, path=args.path,
                                   train_weights=args.weights == "full",
                                   quantized_base=args.weights == "qlora",
                                   **_lora_kwargs(args),
                                   host_link_gbytes_per_s=args.host_link_gbytes_per_s,
                                   **_rate_kwargs(args, S))
    except ValueError as e:
        print(f"{where} does not fit: {e}")
        try:
            seg = choose_segment_layers(layers, V, B, S, dtype, room, host, path=args.path,
                                        **_segment_choice_kwargs(args, S))
        except ValueError:
            return
        print(f"  min_memory in segments fits: --segment-layers {seg.segment_layers} "
              f"(the fastest K that fits, ckpt_ext.plan.choose_segment_layers), device peak "
              f"{format_bytes(seg.peak)}, host {format_bytes(seg.host)}, step s "
              f"{seg.seconds:,.2f}")
        return
    counts = ", ".join(f"{c.presets.count(p)} x {p}" for p in FUSED_PRESETS if p in c.presets)
    print(f"{where} fits with {counts}; device peak {format_bytes(c.peak)} (state + peak + "
          f"kept free {format_bytes(outside + c.peak)}), host "
          f"{format_bytes(c.host)}, kept on device {format_bytes(c.kept)}; step s "
          f"{c.seconds:,.2f}, tokens/s {B * S / c.seconds:,.0f} (each layer the larger of its "
          f"compute and its host copies at {args.host_link_gbytes_per_s:g} GB/s, the rule "
          f"of patch_llama(policy='auto', offload='cpu'))")
    print("  per layer: " + " ".join(c.presets))


def _rate_kwargs(args, S: int, strict: bool = False) -> dict:
    """The step time estimate's rates at S (``strict``: the attention backward's under
    torch's determinism flag): the throughputs file's, each replaced by its --*-tflops flag
    when given."""
    kw = args.rates.step_time_kwargs(S, strict=strict)
    for key in kw:
        if getattr(args, key) is not None:
            kw[key] = getattr(args, key)
    return kw


def _model_state(args, layers, V, dtype, shard: Optional[int] = None) -> int:
    """The model state per GPU of --weights and --expert-lora-rank, sharded --shard ways (or
    ``shard``): ckpt_ext.plan.model_state_bytes."""
    return model_state_bytes(layers, V, dtype, args.weights, shard=shard or args.shard,
                             expert_lora_rank=args.expert_lora_rank, **_quant_kwargs(args))


def _quant_kwargs(args) -> dict:
    """With --weights qlora, --quant and its double quantization (model_state_bytes)."""
    if args.weights != "qlora":
        return {}
    return {"quant": args.quant, "double_quant": not args.no_double_quant}


def _lora_kwargs(args) -> dict:
    """With --weights lora or qlora, the adapters whose GEMMs the FLOPs count
    (ckpt_ext.plan.step_flops): rank LORA_RANK on every projection, --expert-lora-rank on the
    routed experts."""
    if args.weights not in ("lora", "qlora"):
        return {}
    return {"lora_rank": LORA_RANK, "expert_lora_rank": args.expert_lora_rank}


def _seconds(args, setup, layers, V, B, S, strict: bool = False,
             segment_layers: int = 1) -> float:
    return step_time_estimate(setup, layers, V, B, S, train_weights=args.weights == "full",
                              segment_layers=segment_layers, **_lora_kwargs(args),
                              **_rate_kwargs(args, S, strict))


def _segments(args) -> int:
    """The K of --segment-layers for the rows (auto: resolved by _resolve_segments)."""
    return getattr(args, "segments", None) or (
        args.segment_layers if isinstance(getattr(args, "segment_layers", 1), int) else 1)


def _segment_name(k: int) -> str:
    return f"min_memory in {k}-layer segments"


def _stream_name(k: int) -> str:
    return (_segment_name(k) if k > 1 else "min_memory") + " + offload, streamed inputs"


def _stream_segments(args) -> int:
    """The K of the streamed rows (--offload-stream): --segment-layers K, or for 'auto' the K
    resolved with the streamed step (_resolve_segments)."""
    return getattr(args, "stream_segments", None) or _segments(args)


def _stream_seconds(args, layers, V, B, S, dtype, k: int, host) -> float:
    """The step time estimate of the streamed step: _seconds plus its copies serialized with
    compute at --host-link-gbytes-per-s (ckpt_ext.plan.stream_copy_bytes)."""
    return (_seconds(args, "min_memory", layers, V, B, S, segment_layers=k)
            + stream_copy_bytes(layers, B, S, dtype, k, host)
            / (args.host_link_gbytes_per_s * 1e9))


def _segment_choice_kwargs(args, S: int, stream: bool = False) -> dict:
    """choose_segment_layers' keywords from the CLI's arguments at S (``stream``: the
    streamed step's)."""
    return dict(offload=args.offload, stream=stream, train_weights=args.weights == "full",
                quantized_base=args.weights == "qlora", **_lora_kwargs(args),
                host_link_gbytes_per_s=args.host_link_gbytes_per_s, **_rate_kwargs(args, S))


def _segment_room(args, layers, V, dtype) -> tuple:
    """(the device memory left for the step, the memory kept free, the host cap or None)."""
    headroom = headroom_bytes(args.device_memory, args.cuda_context, args.fragmentation)
    room = args.device_memory - headroom - _model_state(args, layers, V, dtype)
    return room, headroom, (_host_memory(args)[0] if args.offload else None)


def _resolve_segments(args, layers, V, B, S, dtype, stream: bool = False) -> int:
    """The K the rows use: --segment-layers K, or for 'auto' the K of least estimated time
    that fits at S (ckpt_ext.plan.choose_segment_layers; under --sequence-parallel the
    smallest K whose per-GPU step fits), else the K of the longest S over every K
    (``stream``: of the streamed step)."""
    if args.segment_layers != "auto":
        return args.segment_layers
    room, headroom, host = _segment_room(args, layers, V, dtype)
    N = args.sequence_parallel
    if room > 0 and N > 1:
        for k in range(1, len(layers) + 1):
            if sp_step_peak("min_memory", layers, V, B, S, N, dtype, path=args.path,
                            train_weights=args.weights == "full", offload=args.offload,
                            host_limit=host, segment_layers=k).peak <= room:
                return k
    elif room > 0:
        try:
            return choose_segment_layers(layers, V, B, S, dtype, room, host, path=args.path,
                                         **_segment_choice_kwargs(args, S, stream)
                                         ).segment_layers
        except ValueError:
            pass
    return _longest_segments(args, layers, V, B, dtype, stream)[1]


def _longest_segments(args, layers, V, B, dtype, stream: bool = False) -> tuple:
    """(the longest S of min_memory over every K, the smallest K reaching it; ``stream``: of
    the streamed step)."""
    room, headroom, host = _segment_room(args, layers, V, dtype)
    if room <= 0:
        return 0, 1
    return longest_sequence_segments(
        layers, V, B, dtype, args.device_memory, args.weights, offload=args.offload,
        host_memory=host, sequence_parallel=args.sequence_parallel, path=args.path,
        headroom=headroom, shard=args.shard, expert_lora_rank=args.expert_lora_rank,
        stream=stream, **_quant_kwargs(args))


def _print_auto_segments(args, layers, V, B, S, dtype, room, host, headroom,
                         stream: bool = False) -> None:
    """--segment-layers auto: the K chosen at S and the longest S over every K (``stream``:
    of the streamed step, its copies serialized with compute in its times)."""
    off = (" + offload, streamed inputs" if stream else " + offload") if args.offload else ""
    where = f"segments (--segment-layers auto), min_memory{off}:"
    try:
        c = choose_segment_layers(layers, V, B, S, dtype, room, host, path=args.path,
                                  **_segment_choice_kwargs(args, S, stream)) \
            if room > 0 else None
    except ValueError:
        c = None
    link = f"{args.host_link_gbytes_per_s:g} GB/s"
    copies = (f"its input's copy to host memory, plus the copies serialized with compute "
              f"(the streamed backward's and the rebuild's) at {link}" if stream else
              f"its host copies at {link}" if args.offload else "nothing else")
    if c is None:
        at = f"at S {S:,} no K fits"
    else:
        at = (f"at S {S:,} K {c.segment_layers} (the least estimated time that fits: each "
              f"segment the larger of its compute, the rebuild's forward included, and "
              f"{copies}), device peak {format_bytes(c.peak)}, step s {c.seconds:,.2f}")
    if c is not None and stream:
        at += f", host {format_bytes(c.host)}"
    n, k = _longest_segments(args, layers, V, B, dtype, stream)
    secs = (_stream_seconds(args, layers, V, B, n, dtype, k, host) if stream else
            _seconds(args, 'min_memory', layers, V, B, n, segment_layers=k)) if n else 0
    longest = (f"the longest S over K = 1..{len(layers)}: {_longest_text(n)} with K {k}, step s "
               f"{secs:,.2f}" if n else "no S fits")
    print(f"{where} {at}; {longest} (ckpt_ext.plan.longest_sequence_segments)")


def _rates_words(args, S: int) -> str:
    kw = _rate_kwargs(args, S)
    src = args.rates.source if args.throughputs is not None else "the plan's H100 rates"
    return (f"{kw['attention_fwd_tflops']:g} / {kw['attention_bwd_tflops']:g} TFLOP/s for the "
            f"attention forward / backward and {kw['matmul_tflops']:g} for matmuls at S {S:,} "
            f"({src}; the longest S's time at its own length)")


def sequence_parallel_rows(args, layers, V, B, S, dtype, N):
    """The sequence-parallel rows at N GPUs: one per fused preset (and with --offload per
    fused preset offloaded), each a dict of per-GPU figures."""
    train = args.weights == "full"
    host = _host_memory(args)[0] if args.offload else None
    memory = args.device_memory
    if memory is not None:
        headroom = headroom_bytes(memory, args.cuda_context, args.fragmentation)
        room = memory - headroom - _model_state(args, layers, V, dtype)
    k = _segments(args)
    cases = [(p, False, 1) for p in OFFLOAD_SETUPS]
    if args.offload:
        cases += [(p, True, 1) for p in OFFLOAD_SETUPS]
    if k > 1:
        cases += [("min_memory", False, k)] + ([("min_memory", True, k)] if args.offload else [])
    rows = []
    for setup, offload, seg in cases:
        p = sp_step_peak(setup, layers, V, B, S, N, dtype, path=args.path, train_weights=train,
                         offload=offload, host_limit=host, segment_layers=seg)
        fwd = bwd = 0
        if N > 1:
            fwd, bwd = sp_exchange_bytes(setup, layers[0], B, S, N, dtype)
        compute, comm = sp_step_time(setup, layers, V, B, S, N, dtype, train_weights=train,
                                     **_lora_kwargs(args), segment_layers=seg,
                                     link_gbytes_per_s=args.link_gbytes_per_s,
                                     **_rate_kwargs(args, S))
        name = setup if seg == 1 else _segment_name(seg)
        row = {"setup": name + (" + offload" if offload else ""), "saved": p.saved,
               "peak": p.peak, "phase": p.phase, "host": p.host, "a2a_fwd": fwd,
               "a2a_bwd": bwd, "compute_s": compute, "a2a_s": comm, "step_s": compute + comm,
               "tokens_per_s": B * S / (compute + comm), "fits": None, "longest": None}
        if memory is not None:
            row["fits"] = room > 0 and p.peak <= room
            row["longest"] = 0 if room <= 0 else sp_longest_sequence(
                setup, layers, V, B, N, dtype, memory, args.weights, path=args.path,
                offload=offload, host_memory=host, headroom=headroom, shard=args.shard,
                expert_lora_rank=args.expert_lora_rank, segment_layers=seg)
            if row["longest"]:
                c, m = sp_step_time(setup, layers, V, B, row["longest"], N, dtype,
                                    train_weights=train, **_lora_kwargs(args),
                                    segment_layers=seg,
                                    link_gbytes_per_s=args.link_gbytes_per_s,
                                    **_rate_kwargs(args, row["longest"]))
                row["longest_step_s"] = c + m
        rows.append(row)
    return rows


def _print_sequence_parallel(args, layers, V, B, S, dtype) -> None:
    """The sequence-parallel table: per GPU, per fused preset."""
    N = args.sequence_parallel
    S_l = sp_local_tokens(S, N)
    print(f"sequence parallel over {N} GPUs (Ulysses in the fused layer; "
          f"{_weights_words(args)}, {args.path} path): per GPU {B} x {S_l:,} tokens of the "
          f"{S:,}-token sequence, attention over all {S:,} with {layers[0].num_heads // N} of "
          f"{layers[0].num_heads} query heads")
    header = ["per GPU", "saved", "device peak", "host", "all-to-all fwd/layer",
              "all-to-all bwd/layer", "step s (a2a s)", "tokens/s"]
    if args.device_memory is not None:
        header += [f"at S {S:,}", "longest S", "its step s"]
    table = []
    for r in sequence_parallel_rows(args, layers, V, B, S, dtype, N):
        cells = [r["setup"], format_bytes(r["saved"]), format_bytes(r["peak"]),
                 format_bytes(r["host"]), format_bytes(r["a2a_fwd"]),
                 format_bytes(r["a2a_bwd"]), f"{r['step_s']:,.2f} ({r['a2a_s']:,.2f})",
                 f"{r['tokens_per_s']:,.0f}"]
        if args.device_memory is not None:
            cells += ["fits" if r["fits"] else "does not fit", _longest_text(r["longest"]),
                      f"{r['longest_step_s']:,.2f}" if r["longest"] else "-"]
        table.append(cells)
    print(_table(table, header))
    print(f"sequence parallel: each all-to-all sends (N-1)/N of the rank's tensor and receives "
          f"as much; forward q, k, v, out, lse; backward q, k, v, out, lse, dout out and dq, "
          f"dk, dv back (min_memory as many: its recomputed out and lse go back, their "
          f"exchanged copies serve the backward); 'host' is one GPU's offloaded layers; the "
          f"peak counts the gathered k, v and their fp32 gradient sums over all {S:,} tokens "
          f"for the GPU's KV heads (as many values as its own k, v) and one query chunk's "
          f"exchanged copies; "
          f"step s: the FLOPs / N at the rates above plus the all-to-all bytes at "
          f"{args.link_gbytes_per_s:g} GB/s, not overlapped (ESTIMATES); the model state per "
          f"GPU is the --shard figure")
    if args.segment_layers == "auto" and args.device_memory is not None:
        n, k = _longest_segments(args, layers, V, B, dtype)
        off = " + offload" if args.offload else ""
        if n:
            c, m = sp_step_time("min_memory", layers, V, B, n, N, dtype,
                                train_weights=args.weights == "full", **_lora_kwargs(args),
                                segment_layers=k, link_gbytes_per_s=args.link_gbytes_per_s,
                                **_rate_kwargs(args, n))
            print(f"segments (--segment-layers auto), min_memory{off} on {N} GPUs: the rows use "
                  f"K {_segments(args)} (the smallest whose per-GPU step fits at S {S:,}); "
                  f"the longest S over K = 1..{len(layers)}: {_longest_text(n)} with K {k}, "
                  f"step s {c + m:,.2f} (ckpt_ext.plan.longest_sequence_segments)")
        else:
            print(f"segments (--segment-layers auto), min_memory{off} on {N} GPUs: no S fits")


def _smallest_shard(layers, V, B, S, dtype, args, headroom) -> int:
    """The smallest sharding degree (up to 4096) at which min_memory fits S, or 0."""
    peak = step_peak("min_memory", layers, V, B, S, dtype, path=args.path,
                     train_weights=args.weights == "full").peak
    for n in range(1, 4097):
        if _model_state(args, layers, V, dtype, shard=n) + peak + headroom <= args.device_memory:
            return n
    return 0


if __name__ == "__main__":
    sys.exit(main())
