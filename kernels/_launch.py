"""The launch policy shared by every Triton kernel of ``ckpt_ext.kernels``.

One module decides, for all kernel families (attention, SwiGLU, LM-head loss):

* **Interpreter.** ``INTERPRET`` is True when the kernels run in Triton's CPU interpreter. It
  is decided the way Triton decides it: ``@triton.jit`` makes an interpreted function when
  ``TRITON_INTERPRET`` is set at the moment the kernel is defined, so the flag is taken, once,
  from a probe kernel defined when this module is imported (by the first kernel module, that
  is at the first Triton launch: ``ckpt_ext`` imports the kernels lazily).
* **Settings.** Autotuning and the SwiGLU variants are settings of ``ckpt_ext.config`` (the
  README's "Kernel settings" table), read when a launcher is built: :func:`autotuning` (off
  in the interpreter) decides between ``triton.autotune`` over the kept candidates and
  the first kept candidate, untimed; ``swiglu_grid`` and ``swiglu_epilogue`` pick the
  SwiGLU kernels' variants. A change of any of them (``config.patch``, ``config.reload``)
  empties every launcher cache, so the next launch follows it; :func:`reload_policy` reads
  the environment again and empties the caches in any case (tests, benchmarks). The
  defaults are the winners measured on an H100 (``bench/swiglu.py``, LLaMA-3-8B MLP, 8192
  tokens, bf16): the persistent grid took 0.97x the time of ``tiles`` (``save="input"``
  forward+backward 16.5 against 17.0 ms), the subtiled epilogue 0.98x that of ``whole``
  (17.0 against 17.3 ms).
* **fp32 dot precision.** :func:`dot_precision`: fp32 operands use IEEE fp32 products when
  torch's float32 matmul precision is ``"highest"`` (torch's default) and TF32 when the user
  allowed it with ``torch.set_float32_matmul_precision("high"/"medium")``, the rule torch's
  own matmuls follow, so a fused kernel is as exact as the matmuls it replaces under every
  setting. Read at every launch with fp32 operands, as torch reads it at every matmul; the
  result is part of the launcher cache key. fp16/bf16 operands are unaffected (tensor-core
  dots with fp32 accumulation).
* **Launcher caches.** Everything a launch decides from its specialization (device, dtype,
  head_dim or shape class, causal, mask kind, flags) rather than from the tensors' values is
  computed once per key by a function decorated with :func:`cached`: the kernel to launch
  (plain, autotuned or first-that-fits), its constexpr arguments, the device's architecture
  family and shared memory. A launch then costs a cache lookup, the argument checks and the
  kernel call.
* **Device.** :func:`on_device` makes a CUDA tensor's device current for the launch (Triton
  launches on the current device), and is free when it already is.
* **Pruning by what the compiler reports.** A kernel module lists its candidates in order of
  preference; on a GPU, :class:`Pruned` compiles them at the first launch of a cache key
  (for that launch's arguments, without running them) and keeps those whose compiled kernel
  spills no registers and fits the device's shared memory (:func:`fits`, on the
  :class:`Resources` the driver reports, as Inductor reads them: ``n_regs``, ``n_spills``,
  ``metadata.shared``). With autotuning off it compiles in order and stops at the first that
  fits. No hand-fitted register or shared-memory model is involved; ``tools/
  check_triton_compile.py`` applies the same :func:`prune` to ahead-of-time compiles.

Kernel modules use :func:`select` to turn a candidate list into the launcher of one key, and
expose their candidates through public functions that ``tools/check_triton_compile.py``
reads.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Optional, Sequence

import torch
import triton
from triton.runtime.errors import OutOfResources

from .. import config

__all__ = ["INTERPRET", "autotuning", "reload_policy",
           "dot_precision", "cached", "DeviceInfo", "arch_family", "smem_budget_for",
           "device_info", "on_device", "placeholder", "check_operands", "FirstThatFits", "Fixed",
           "Resources", "fits", "prune", "Pruned", "select", "cdiv", "next_pow2", "pow2_bucket"]


# --------------------------------------------------------------------------------------------
# Interpreter and autotuning: decided once
# --------------------------------------------------------------------------------------------
@triton.jit
def _mode_probe(X):
    pass


def _interpreting() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - every supported triton has it
        return False
    return isinstance(_mode_probe, InterpretedFunction)


INTERPRET: bool = _interpreting()

_CACHES: list = []

# The settings a cached launcher is built from; a change of one of them empties the caches.
_LAUNCHER_SETTINGS = ("autotune", "swiglu_grid", "swiglu_epilogue")


def autotuning() -> bool:
    """Whether launchers built now autotune: the ``autotune`` setting, off in the
    interpreter."""
    return (not INTERPRET) and config.current().autotune


def _clear_caches() -> None:
    for cache in _CACHES:
        cache.cache_clear()


def _follow_settings(old: config.KernelConfig, new: config.KernelConfig) -> None:
    if any(getattr(old, f) != getattr(new, f) for f in _LAUNCHER_SETTINGS):
        _clear_caches()


config.on_change(_follow_settings)


def reload_policy() -> None:
    """Read the kernel settings from the environment again (``ckpt_ext.config.reload``) and
    forget every cached launcher (and the device information), so that the next launch
    follows the current environment. The interpreter flag cannot change: Triton fixed it when
    the kernels were defined."""
    config.reload()
    _clear_caches()


def cached(fn: Callable) -> Callable:
    """Memoize a launcher builder on its (hashable) arguments; :func:`reload_policy` clears it."""
    wrapped = functools.lru_cache(maxsize=None)(fn)
    _CACHES.append(wrapped)
    return wrapped


# --------------------------------------------------------------------------------------------
# fp32 dot precision
# --------------------------------------------------------------------------------------------
def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of ``tl.dot`` for operands of ``dtype``: "ieee" for fp32 under
    torch's "highest" float32 matmul precision, "tf32" for fp32 under "high" / "medium" (the
    user allowed TF32 for fp32 matmuls) and for fp16/bf16 (where Triton ignores it)."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


# --------------------------------------------------------------------------------------------
# Devices
# --------------------------------------------------------------------------------------------
class DeviceInfo:
    """What the launchers need to know about a device, queried once per device."""

    __slots__ = ("arch", "capability", "smem_budget", "sm_count")

    def __init__(self, arch: str, capability: tuple, smem_budget: int, sm_count: int):
        self.arch = arch                  # candidate family: "hopper" (sm_90+) or "ampere"
        self.capability = capability      # (major, minor)
        self.smem_budget = smem_budget    # bytes of shared memory one block may opt into
        self.sm_count = sm_count

    def __repr__(self):
        return (f"DeviceInfo(arch={self.arch!r}, capability={self.capability}, "
                f"smem_budget={self.smem_budget}, sm_count={self.sm_count})")


def arch_family(major: int) -> str:
    """The candidate family of a compute capability: Hopper and newer, else Ampere."""
    return "hopper" if major >= 9 else "ampere"


def smem_budget_for(capability: tuple) -> int:
    """Per-block opt-in shared memory of a capability when the driver does not report it:
    227 KiB on sm_90, 163 KiB on sm_80 (A100), 99 KiB on other Ampere / Ada parts."""
    major, minor = capability
    return 227 * 1024 if major >= 9 else (163 * 1024 if (major, minor) == (8, 0) else 99 * 1024)


@cached
def device_info(device: torch.device) -> DeviceInfo:
    """Architecture family, shared-memory budget and SM count of a CUDA device (cached)."""
    props = torch.cuda.get_device_properties(device)
    cap = (props.major, props.minor)
    budget = int(getattr(props, "shared_memory_per_block_optin", 0) or smem_budget_for(cap))
    return DeviceInfo(arch_family(props.major), cap, budget, props.multi_processor_count)


_NULL = contextlib.nullcontext()


@cached
def placeholder(device: torch.device) -> torch.Tensor:
    """A one-element fp32 tensor on ``device`` for pointer arguments a specialization never
    touches (absent biases, adapters, buffers); shared, never written."""
    return torch.zeros((1,), dtype=torch.float32, device=device)


def on_device(device: torch.device):
    """A context in which ``device`` is the current CUDA device; a no-op for CPU tensors and
    when it already is current (the common case: no device switch per launch)."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return _NULL
    return torch.cuda.device(device)


# --------------------------------------------------------------------------------------------
# What the Triton kernels add to an op's argument checks
# --------------------------------------------------------------------------------------------
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_operands(op: str, *named, uses_dot: bool = True) -> None:
    """The Triton-only rules, after the op's own checks (``ckpt_ext._checks``, shared with its
    fake, which already gave the shapes, dtypes and devices): every ``(name, tensor)`` given
    (None skipped) is float16, bfloat16 or float32 (TypeError); the first one is on a CUDA
    device, or on the CPU under the interpreter (RuntimeError, as for tensors on different
    devices); for kernels with ``tl.dot`` (``uses_dot``) bfloat16 is refused under the
    interpreter, whose bf16 ``tl.dot`` is wrong (NotImplementedError)."""
    for name, t in named:
        if t is not None and t.dtype not in _KERNEL_DTYPES:
            raise TypeError(f"{op}: {name} must be float16, bfloat16 or float32 for the Triton "
                            f"kernels, got {str(t.dtype).replace('torch.', '')}")
    name, first = named[0]
    if first.device.type != "cuda" and not INTERPRET:
        raise RuntimeError(f"{op}: {name} is on {first.device}; the Triton kernels need a CUDA "
                           f"device (CPU tensors only with TRITON_INTERPRET=1 set before triton "
                           f"is imported)")
    if uses_dot and first.dtype == torch.bfloat16 and INTERPRET:
        raise NotImplementedError(
            f"{op}: bfloat16 is not supported under the Triton interpreter (TRITON_INTERPRET=1), "
            f"whose bf16 tl.dot gives wrong results (triton#11584); use float16 or float32 "
            f"there, or the ATen CPU kernels (leave CKPT_EXT_BACKEND unset)")


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def _config_kwargs(c) -> dict:
    """A config's launch arguments: its meta-parameters, warps and stages, and the CUDA
    backend's register cap (``maxnreg``) and cluster size (``num_ctas``) where it sets them."""
    kw = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
    if getattr(c, "maxnreg", None) is not None:
        kw["maxnreg"] = c.maxnreg
    if getattr(c, "num_ctas", 1) != 1:
        kw["num_ctas"] = c.num_ctas
    return kw


class Fixed:
    """A kernel launched with fixed meta-parameters: ``Fixed(kernel, meta)[grid](*args)``.
    ``meta`` is a mapping, or a zero-argument callable returning one (read at each launch, so
    that tests can change the interpreter's block sizes)."""

    __slots__ = ("kernel", "meta")

    def __init__(self, kernel, meta):
        self.kernel, self.meta = kernel, meta

    def __getitem__(self, grid):
        kernel, meta = self.kernel, self.meta

        def launch(*args, **kwargs):
            m = meta() if callable(meta) else meta
            return kernel[grid](*args, **kwargs, **m)

        return launch


class FirstThatFits:
    """The untimed launcher when the ``autotune`` setting is off: launches the first of
    ``configs`` that the device accepts. A resource model is a model; Triton's own allocation
    can exceed it, and such a config fails at launch with OutOfResources before anything
    runs. The launcher then moves on to the next config and remembers where it got to: one
    FirstThatFits serves one launcher-cache key (one specialization), so later launches start
    at the config that fitted."""

    def __init__(self, kernel, configs: Sequence):
        if not configs:
            raise ValueError("FirstThatFits: configs must not be empty")
        self.kernel, self.configs = kernel, list(configs)
        self._kwargs = [_config_kwargs(c) for c in self.configs]
        self.start = 0

    @property
    def chosen(self):
        """The config launched last (the first one before any launch)."""
        return self.configs[self.start]

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            try:
                return self.kernel[grid](*args, **kwargs, **self._kwargs[self.start])
            except OutOfResources as exc:
                errors = [f"{self.configs[self.start]}: {exc}"]
            for i in range(self.start + 1, len(self.configs)):
                try:
                    out = self.kernel[grid](*args, **kwargs, **self._kwargs[i])
                except OutOfResources as exc:
                    errors.append(f"{self.configs[i]}: {exc}")
                    continue
                self.start = i
                return out
            raise RuntimeError(f"{getattr(self.kernel, '__name__', 'kernel')}: no candidate "
                               f"configuration fits this device: " + "; ".join(errors))

        return launch


@dataclasses.dataclass(frozen=True)
class Resources:
    """What the compiler reports for one compiled kernel, as the driver gives it: registers
    per thread, spilled 32-bit words per thread (its local memory / 4) and shared memory bytes.
    ``tools/check_triton_compile.py`` builds the same from an ahead-of-time compile."""

    regs: int
    spills: int
    shared: int

    @classmethod
    def of(cls, compiled) -> "Resources":
        """Of a triton ``CompiledKernel``, loaded on the current device (loading is where the
        driver reports registers and spills; it raises OutOfResources when the kernel does
        not fit the device at all)."""
        compiled._init_handles()
        return cls(int(compiled.n_regs), int(compiled.n_spills), int(compiled.metadata.shared))


def fits(resources: Optional[Resources], smem_budget: int, max_spills: int = 0) -> bool:
    """Whether a compiled candidate is kept: it loaded (``resources`` is not None), spills
    nothing (at most ``max_spills`` words per thread, where a measurement found such a
    config faster), and its shared memory is within the device's per-block budget."""
    return (resources is not None and resources.spills <= max_spills
            and resources.shared <= smem_budget)


def prune(configs: Sequence, resources: Sequence, smem_budget: int,
          group: Optional[Callable] = None, max_spills: int = 0) -> list:
    """The candidates to launch, in their order: those whose compiled kernel ``fits`` (with
    ``group``, a function of a config: only the first that fits of each group, e.g. the widest
    epilogue piece of one tile). When none does, the one that spills least among those within
    shared memory (the less shared memory on a tie), so that something runs; [] when none
    even loads. ``resources``: one :class:`Resources` (or None: did not load) per config."""
    kept, groups = [], set()
    for c, r in zip(configs, resources):
        g = group(c) if group is not None else id(c)
        if fits(r, smem_budget, max_spills) and g not in groups:
            kept.append(c)
            groups.add(g)
    if kept:
        return kept
    loadable = [(r.spills, r.shared, i) for i, r in enumerate(resources)
                if r is not None and r.shared <= smem_budget]
    return [configs[min(loadable)[2]]] if loadable else []


class Pruned:
    """The launcher of one cache key on a GPU: at its first launch it compiles the candidates
    for that launch's arguments (``warmup``: compiled, not run), keeps what :func:`prune`
    keeps of them, and from then on launches the first kept one untimed (autotuning off: the
    candidates are compiled in order only until one fits) or ``triton.autotune`` over the
    kept ones; ``group``: as for :func:`prune` (a config whose group already fits is not
    compiled). ``report``: (config, Resources or None) for each candidate compiled."""

    def __init__(self, kernel, configs: Sequence, smem_budget: int, autotune: bool,
                 key: Sequence[str], autotune_kwargs: dict, group: Optional[Callable] = None,
                 max_spills: int = 0):
        if not configs:
            raise ValueError("Pruned: configs must not be empty")
        self.kernel, self.configs, self.smem_budget = kernel, list(configs), smem_budget
        self.autotune, self.key, self.autotune_kwargs = autotune, list(key), autotune_kwargs
        self.group, self.max_spills = group, max_spills
        self.kept: Optional[list] = None
        self.report: list = []
        self._launcher = None

    def _resources(self, config, grid, args, kwargs) -> Optional[Resources]:
        try:
            compiled = self.kernel.warmup(*args, grid=grid, **kwargs, **_config_kwargs(config))
            return Resources.of(compiled)
        except OutOfResources:
            return None

    def _build(self, grid, args, kwargs):
        fitted = set()
        for c in self.configs:
            g = self.group(c) if self.group is not None else id(c)
            if g in fitted:
                continue
            self.report.append((c, self._resources(c, grid, args, kwargs)))
            if fits(self.report[-1][1], self.smem_budget, self.max_spills):
                if not self.autotune:
                    break
                fitted.add(g)
        configs, resources = zip(*self.report)
        self.kept = prune(configs, resources, self.smem_budget, self.group, self.max_spills)
        if not self.kept:
            raise RuntimeError(f"{getattr(self.kernel, '__name__', 'kernel')}: no candidate "
                               f"configuration loads on this device: {self.report}")
        if self.autotune and len(self.kept) > 1:
            return triton.autotune(configs=self.kept, key=self.key,
                                   **self.autotune_kwargs)(self.kernel)
        return FirstThatFits(self.kernel, self.kept)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if self._launcher is None:
                self._launcher = self._build(grid, args, kwargs)
            return self._launcher[grid](*args, **kwargs)

        return launch


def select(kernel, configs: Sequence, *, interpret_meta, key: Sequence[str],
           smem_budget: Optional[int] = None, group: Optional[Callable] = None,
           max_spills: int = 0, **autotune_kwargs):
    """The launcher of one cache key, following the policy.

    kernel: the ``@triton.jit`` function; configs: its candidates for this key, in order of
    preference; interpret_meta: the fixed block sizes of interpreter runs (a mapping or a
    zero-argument callable); smem_budget: the device's per-block shared memory, to prune the
    candidates by their compiled resources (:class:`Pruned`); None: launched as given (the
    first with autotuning off); group, max_spills: see :func:`prune`; key, autotune_kwargs:
    ``triton.autotune``'s key and its other
    arguments (``reset_to_zero``, ``restore_value``). Returns an object launched as
    ``launcher[grid](*args, **constexprs)``.
    """
    if INTERPRET:
        return Fixed(kernel, interpret_meta)
    if smem_budget is not None:
        return Pruned(kernel, configs, smem_budget, autotuning(), key, autotune_kwargs, group,
                      max_spills)
    if not autotuning():
        return FirstThatFits(kernel, configs)
    return triton.autotune(configs=list(configs), key=list(key), **autotune_kwargs)(kernel)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code (``triton.cdiv`` is a constexpr function: slower on the host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for host code."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def pow2_bucket(n: int, lo: int, hi: int | None = None) -> int:
    """Autotuning key of a size: the next power of two, at least ``lo`` (at most ``hi``), so
    that a run with varying sequence lengths tunes a handful of times, not once per length."""
    b = max(lo, next_pow2(n))
    return b if hi is None else min(b, hi)
