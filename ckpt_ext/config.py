"""The runtime kernel settings of ckpt_ext, in one typed place.

Each setting is a field of :class:`KernelConfig` with an environment variable and a set of
allowed values (``SETTINGS``); the README's "Kernel settings" table documents what each one
selects.

The environment is read once, at the first use (``import ckpt_ext`` asks for ``backend``);
a bad value raises ValueError naming the variable and its allowed values. After that the
settings change only through :func:`patch` (a block, or a decorated function),
:func:`update` (until changed again) or :func:`reload` (read the environment again).
Whatever depends on a setting follows it: the Triton launcher caches are emptied when ``autotune`` or a SwiGLU setting changes,
the attention backward reads ``attention_dq`` at each launch (it is part of the launcher's
cache key; under "auto" also torch's determinism flag, :func:`determinism`), ``backend``
registers or removes the Triton launchers for CPU tensors, and the CUDA attention reads
``attention_backend`` and ``attention_table`` at each call (``ckpt_ext.attention_route``).

``chunk_bytes`` (``CKPT_EXT_CHUNK_BYTES``), the byte cap of the kernels' token chunks, is
parsed here once (:func:`parse_bytes`, the one byte parser of the package) and handed to the
C++ kernels (``ckpt_ext._C.set_chunk_bytes``), which read it at each call; the planner
(``ckpt_ext.plan``) reads the same field. Whether it was given (:func:`chunk_bytes_pinned`: the
variable set to a value, or ``patch`` / ``update`` with ``chunk_bytes``; ``""`` unsets it)
decides who sizes the fused layer's chunks: a pinned cap is the rule, else
``ckpt_ext.plan.choose_chunk_rows`` picks the rows for time where memory allows.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
from typing import Callable, Iterator

__all__ = ["KernelConfig", "SETTINGS", "current", "patch", "update", "reload", "parse_bytes",
           "determinism", "chunk_bytes_pinned"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | str, what: str = "activation_budget") -> int:
    """Bytes from an int or a string such as "20GiB", "512MB", "1.5 GiB", "4096" (KB/MB/GB/TB
    are powers of 1000, KiB/MiB/GiB/TiB powers of 1024; case-insensitive). ``what`` names the
    argument in the errors (TypeError for another type, ValueError for a negative int or text
    that is not bytes)."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int or a string such as '20GiB', got a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must be non-negative, got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"{what} must be an int or a string such as '20GiB', got "
                        f"{type(value).__name__}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{what}: cannot read {value!r} as bytes; use an int or a number with "
                         f"one of the units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The runtime kernel settings (see the module docstring for each one's variable)."""

    # True: the GPU launchers autotune over their kept candidates; False: they launch the
    # first kept candidate untimed (the next one if the device refuses it).
    autotune: bool = True
    # How the attention backward forms dQ: "auto" (torch's determinism flag decides, read at
    # each backward, see :func:`determinism`: off, the fastest backward the choice table
    # names; on, the fastest deterministic one), "separate" (a kernel of its own,
    # deterministic), "atomic" (added by the dK/dV kernel with fp32 atomics; last bits vary
    # between runs) or "ordered" (added by the dK/dV kernel in a fixed key-block order, the
    # highest key block first; deterministic; segment ids take "separate").
    attention_dq: str = "auto"
    # The fused SwiGLU GEMMs' grid: "persistent" (one program per SM looping over the tiles)
    # or "tiles" (one program per output tile).
    swiglu_grid: str = "persistent"
    # The SwiGLU backward's pointwise epilogue: "subtiled" (column pieces of the tile) or
    # "whole" (the whole tile).
    swiglu_epilogue: str = "subtiled"
    # "auto": the ATen kernels on CPU tensors, Triton on CUDA; "triton": the Triton launchers
    # on CPU tensors too (needs TRITON_INTERPRET=1 before triton is imported).
    backend: str = "auto"
    # Which kernel serves attention on CUDA tensors: "auto" (the choice table, see
    # ckpt_ext.attention_route), or pinned to "triton", "flash", "cudnn" or "efficient" (a
    # pinned SDPA backend that cannot serve a call raises, naming the rule it lacks).
    attention_backend: str = "auto"
    # The choice table "auto" reads: "" for the one shipped with the package, else the path
    # of a table file.
    attention_table: str = ""
    # The byte cap of one token chunk's transient (the fused layer's working set, the LM-head
    # loss's logits, the CPU SwiGLU backward): a positive number of bytes, at most 1 TiB.
    chunk_bytes: int = 64 << 20
    # The attention backward's launch configurations (kernels/attention_tuning.py): "" for the
    # winners file shipped with the package, else the path of one a GPU sweep wrote.
    attention_bwd_configs: str = ""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One field's environment variable and allowed values: ``values`` maps each allowed
    environment string to the field's value, in the order error messages list them."""

    field: str
    env: str
    values: dict   # None: a free value, checked by ``free`` (a file path)
    free: Callable = None

    def parse(self, text: str):
        if self.values is None:
            return self.free(self.env, text)
        if text not in self.values:
            raise ValueError(f"{self.env} must be one of {self._allowed(self.values)}, got "
                             f"{text!r}")
        return self.values[text]

    def check(self, value):
        """A value given to :func:`patch`, as the field holds it: one of the field's values
        (bools only for a bool field, so that 0 / 1 are not taken for False / True), or what
        ``free`` makes of it."""
        if self.values is None:
            return self.free(f"ckpt_ext.config: {self.field} ({self.env})", value)
        allowed = list(self.values.values())
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise ValueError(f"ckpt_ext.config: {self.field} ({self.env}) must be one of "
                             f"{self._allowed(allowed)}, got {value!r}")
        return value

    @staticmethod
    def _allowed(values) -> str:
        return ", ".join(repr(v) for v in values)


def _table_path(name: str, text: str) -> str:
    """The attention_table setting: "" (the shipped table) or the path of an existing file
    (its contents are checked when attention first reads it)."""
    if not isinstance(text, str):  # the settings' errors are ValueErrors
        raise ValueError(f"{name} must be a str, got {text!r}")  # noqa: TRY004
    if text and not os.path.isfile(text):
        raise ValueError(f"{name} must be '' (the shipped table) or the path of an existing "
                         f"file, got {text!r}")
    return text


_MAX_CHUNK_BYTES = 1 << 40


def _byte_cap(name: str, value) -> int:
    """The chunk_bytes setting: an int or a string :func:`parse_bytes` reads ("16777216",
    "16MiB", "64 MB", "1.5GiB"), positive and at most 1 TiB; "" is the default (an empty
    variable is unset)."""
    if value == "":
        return KernelConfig.chunk_bytes
    try:
        n = parse_bytes(value, name)
    except (TypeError, ValueError):
        n = 0
    if not 0 < n <= _MAX_CHUNK_BYTES:
        raise ValueError(f"{name} must be a positive number of bytes (e.g. 16777216 or 16MiB, "
                         f"at most 1 TiB), got {value!r}")
    return n


# The attention_dq values whose backward is bit-reproducible (a vendor backward serves them only
# when it is; ops.attention(deterministic=True) keeps them)
DETERMINISTIC_DQ = ("separate", "ordered")
# How deterministic an attention backward under attention_dq="auto" must be (determinism()):
# "off" the fastest backward, "warn" the fastest and a one-time warning when it is not
# deterministic, "strict" deterministic backwards only
DETERMINISM = ("off", "warn", "strict")
_asked = threading.local()


def determinism() -> str:
    """How deterministic the attention backward under ``attention_dq="auto"`` must be, read
    at each backward: what ``ops.attention(..., deterministic=)`` asked for the backward
    running in this thread (:func:`asking_determinism`), else torch's flag:
    ``torch.use_deterministic_algorithms(True)`` "strict", with ``warn_only=True`` "warn",
    off "off" (one of :data:`DETERMINISM`)."""
    asked = getattr(_asked, "value", None)
    if asked is not None:
        return asked
    import torch

    if not torch.are_deterministic_algorithms_enabled():
        return "off"
    return "warn" if torch.is_deterministic_algorithms_warn_only_enabled() else "strict"


@contextlib.contextmanager
def asking_determinism(value) -> Iterator[None]:
    """:func:`determinism` answers ``value`` (one of :data:`DETERMINISM`, or None: torch's
    flag) in this thread for the block: ``ops.attention``'s backward under "auto"."""
    if value is not None and value not in DETERMINISM:
        raise ValueError(f"determinism must be None or one of {DETERMINISM}, got {value!r}")
    before = getattr(_asked, "value", None)
    _asked.value = value
    try:
        yield
    finally:
        _asked.value = before


SETTINGS = {s.field: s for s in (
    Setting("autotune", "CKPT_EXT_AUTOTUNE", {"0": False, "1": True}),
    Setting("attention_dq", "CKPT_EXT_ATTN_DQ", {m: m for m in ("auto", "separate", "atomic",
                                                               "ordered")}),
    Setting("swiglu_grid", "CKPT_EXT_SWIGLU_GRID", {"tiles": "tiles",
                                                    "persistent": "persistent"}),
    Setting("swiglu_epilogue", "CKPT_EXT_SWIGLU_EPILOGUE", {"subtiled": "subtiled",
                                                            "whole": "whole"}),
    Setting("backend", "CKPT_EXT_BACKEND", {"auto": "auto", "triton": "triton"}),
    Setting("attention_backend", "CKPT_EXT_ATTN_BACKEND",
            {b: b for b in ("auto", "triton", "flash", "cudnn", "efficient")}),
    Setting("attention_table", "CKPT_EXT_ATTN_TABLE", None, _table_path),
    Setting("chunk_bytes", "CKPT_EXT_CHUNK_BYTES", None, _byte_cap),
    Setting("attention_bwd_configs", "CKPT_EXT_ATTN_BWD_CONFIGS", None, _table_path),
)}

_lock = threading.RLock()
_current: KernelConfig | None = None
_listeners: list = []
# Whether chunk_bytes was given (chunk_bytes_pinned); read with the environment
_chunk_pinned = False
_CHUNK_ENV = "CKPT_EXT_CHUNK_BYTES"


def from_environment(environ=None) -> KernelConfig:
    """The settings the environment (``os.environ`` by default) gives: each variable's value,
    or the field's default where it is unset. Reads only; :func:`reload` applies them."""
    environ = os.environ if environ is None else environ
    defaults = KernelConfig()
    return KernelConfig(**{
        name: s.parse(environ[s.env]) if s.env in environ else getattr(defaults, name)
        for name, s in SETTINGS.items()})


def current() -> KernelConfig:
    """The settings in effect: the environment's, read at the first call, as changed since
    by :func:`patch` or :func:`reload`."""
    global _current, _chunk_pinned
    config = _current
    if config is None:
        with _lock:
            if _current is None:
                _current = from_environment()
                _chunk_pinned = bool(os.environ.get(_CHUNK_ENV))
            config = _current
    return config


def chunk_bytes_pinned() -> bool:
    """Whether the ``chunk_bytes`` setting was given: ``CKPT_EXT_CHUNK_BYTES`` set to a value
    when the environment was read, or ``chunk_bytes`` passed to :func:`patch` (inside its
    block) or :func:`update` (until changed again); ``""`` there, as an empty variable, unsets
    it (the default cap). A pinned cap sizes the fused layer's token chunks as it says; unpinned,
    ``ckpt_ext.plan.choose_chunk_rows`` picks them where a memory budget is known."""
    current()
    return _chunk_pinned


def _pins(changes: dict):
    """What ``changes`` makes of the pin (None: no chunk_bytes among them)."""
    return None if "chunk_bytes" not in changes else changes["chunk_bytes"] != ""


def on_change(listener: Callable[[KernelConfig, KernelConfig], None]) -> None:
    """Call ``listener(old, new)`` after every change of the settings (the launch policy
    empties its caches, the backend registers or removes launchers). For ckpt_ext's own
    modules."""
    _listeners.append(listener)


def _set(new: KernelConfig) -> None:
    """Make ``new`` current and tell the listeners; if one of them fails, the previous
    settings come back (the listeners that ran are told) and the error propagates."""
    global _current
    with _lock:
        old = current()
        if new == old:
            return
        _current = new
        done = []
        try:
            for listener in _listeners:
                listener(old, new)
                done.append(listener)
        except BaseException:
            _current = old
            for listener in reversed(done):
                listener(new, old)
            raise


def _validated(changes: dict) -> dict:
    """The changes checked, as the fields hold them."""
    for name in changes:
        if name not in SETTINGS:
            raise TypeError(f"ckpt_ext.config: no setting named {name!r}; the settings are "
                            f"{', '.join(SETTINGS)}")
    return {name: SETTINGS[name].check(value) for name, value in changes.items()}


@contextlib.contextmanager
def patch(**changes) -> Iterator[KernelConfig]:
    """Change settings for a block and restore them after it, on exit and on an exception::

        with ckpt_ext.config.patch(attention_dq="atomic", autotune=False):
            ...

    also as a decorator (``@ckpt_ext.config.patch(swiglu_grid="tiles")``). Values are
    checked as the environment's are (ValueError naming the variable and its values); an
    unknown name is a TypeError. Yields the settings in effect inside the block. The settings
    are process-wide (as the environment is), not per thread."""
    global _chunk_pinned
    pin = _pins(changes)
    changes = _validated(changes)
    with _lock:
        before, pinned = current(), _chunk_pinned
        _set(dataclasses.replace(before, **changes))
        if pin is not None:
            _chunk_pinned = pin
    try:
        yield current()
    finally:
        with _lock:
            _set(before)
            _chunk_pinned = pinned


def update(**changes) -> KernelConfig:
    """Change settings until they are changed again (checked as :func:`patch` checks them):
    for a script or a test that sets one for the rest of its run. Returns the settings."""
    global _chunk_pinned
    pin = _pins(changes)
    changes = _validated(changes)
    with _lock:
        _set(dataclasses.replace(current(), **changes))
        if pin is not None:
            _chunk_pinned = pin
        return current()


def reload() -> KernelConfig:
    """Read the environment again and make its settings current (the listeners run for what
    changed). Returns them."""
    global _chunk_pinned
    config = from_environment()
    with _lock:
        _set(config)
        _chunk_pinned = bool(os.environ.get(_CHUNK_ENV))
    return config

