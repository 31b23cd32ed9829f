"""Per-rank step peak of Ulysses sequence parallelism (the fused layer's ``sequence_parallel``)
against one process running the same global batch.

Spawns one process (no sequence parallelism) and then N gloo processes (each holding S/N
positions of every sequence). Each runs a stack of fused decoder layers (full weights with
gradients, fp32, ``--preset``) over the same global (B, S, H) input: one untimed step (the
weight gradients are allocated there), then the measured step, whose gradients add to them in
place. Per process, two peaks above what is allocated before the step:

* ``heap``: the process's malloc heap in use (glibc ``mallinfo2``: ``uordblks + hblkhd``)
  sampled every 0.2 ms by a thread (the op releases the GIL) and also read before and after
  each layer call. Every allocation of the process counts: torch's tensors and gloo's own
  buffers (what the machine actually holds). A spike shorter than the sampling period can be
  missed.
* ``profiler`` (``--profiler``, a third step): ``ckpt_ext.peak_memory_bytes``
  (torch.profiler's CPU allocator events), for comparison. It was found erratic under gloo
  (the cause is not established; gloo's collectives run on threads of their own, and
  the profiler sees torch's allocator only, not gloo's own buffers), hence the heap reading.

Prints the config, each rank's peaks, the single process's, and the ratio (the largest rank
over the single process), with provenance and load-average headers; ``--out`` writes the
same lines to a file.

    python bench/sequence_parallel.py [--seq 8192] [--world 2] [--preset min_memory] \\
        [--out bench/results/sequence_parallel_cpu.txt]
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def heap_bytes() -> int:
    m = _libc.mallinfo2()
    return m.uordblks + m.hblkhd


class HeapPeak:
    """The most heap in use while open (a sampling thread plus explicit ``sample()`` calls)."""

    def __init__(self, period_s: float = 2e-4):
        self.period, self.peak, self.samples = period_s, 0, 0
        self._stop = threading.Event()

    def sample(self):
        self.peak = max(self.peak, heap_bytes())
        self.samples += 1

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.period)

    def __enter__(self):
        self.base = heap_bytes()
        self.peak = self.base
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()


def build(a):
    """The global batch and the layers' weights (the same on every process: seeded)."""
    g = torch.Generator().manual_seed(0)
    h, hq, hkv, im = a.hidden, a.heads, a.kv_heads, a.intermediate
    d = h // hq
    std = h ** -0.5

    def w(*shape, s=std):
        return (s * torch.randn(*shape, generator=g)).requires_grad_()

    layers = []
    for _ in range(a.layers):
        layers.append({
            "input_layernorm.weight": (1 + 0.1 * torch.randn(h, generator=g)).requires_grad_(),
            "self_attn.q_proj.weight": w(hq * d, h), "self_attn.k_proj.weight": w(hkv * d, h),
            "self_attn.v_proj.weight": w(hkv * d, h), "self_attn.o_proj.weight": w(h, hq * d),
            "post_attention_layernorm.weight":
                (1 + 0.1 * torch.randn(h, generator=g)).requires_grad_(),
            "mlp.gate_proj.weight": w(im, h), "mlp.up_proj.weight": w(im, h),
            "mlp.down_proj.weight": w(h, im, s=im ** -0.5)})
    x = torch.randn(a.batch, a.seq, h, generator=g)
    dy = torch.randn(a.batch, a.seq, h, generator=g) / a.seq
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(a.seq, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat([ang, ang], -1)
    return layers, x, dy, ang.cos().float()[None], ang.sin().float()[None]


def _worker(rank, world, a, init_file, out_file):
    from ckpt_ext import blocks, peak_memory_bytes
    torch.set_num_threads(a.threads)
    name = ""
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=1800))
        name = dist.group.WORLD.group_name
    try:
        layers, x, dy, cos, sin = build(a)
        s = a.seq // world
        cut = slice(rank * s, (rank + 1) * s)
        xs, dys = x[:, cut].contiguous(), dy[:, cut].contiguous()
        cos, sin = cos[:, cut].contiguous(), sin[:, cut].contiguous()
        del x, dy
        opts = [blocks.LayerOptions(weights=w, cos=cos, sin=sin, num_heads=a.heads,
                                    num_kv_heads=a.kv_heads, preset=a.preset,
                                    sequence_parallel=name) for w in layers]
        meter = None

        def step():
            y = xs.clone().requires_grad_()
            for o in opts:
                y = blocks.decoder_layer(y, o)
                if meter is not None:
                    meter.sample()
            y.backward(dys)
            del y

        t0 = time.perf_counter()
        step()  # untimed: allocates the weight gradients
        warm_s = time.perf_counter() - t0
        if world > 1:
            dist.barrier()
        with HeapPeak() as meter:
            t0 = time.perf_counter()
            step()
            step_s = time.perf_counter() - t0
        heap = meter.peak - meter.base
        samples = meter.samples
        profiler = peak_memory_bytes(step) if a.profiler else -1
        torch.save(dict(heap=heap, samples=samples, profiler=profiler, step_s=step_s,
                        warm_s=warm_s), out_file)
        if world > 1:
            dist.barrier()
    finally:
        if world > 1:
            dist.destroy_process_group()


def run(world, a, tmp):
    init = os.path.join(tmp, f"init{world}")
    outs = [os.path.join(tmp, f"w{world}r{r}.pt") for r in range(world)]
    ctx = mp.start_processes(_run_rank, args=(world, a, init, outs), nprocs=world, join=False,
                             start_method="spawn")
    while not ctx.join(timeout=5):
        pass
    return [torch.load(o) for o in outs]


def _run_rank(rank, world, a, init, outs):
    _worker(rank, world, a, init, outs[rank])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1792)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--preset", default="min_memory")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--scale-chunk-cap", action="store_true",
                   help="the N ranks run with CKPT_EXT_CHUNK_BYTES divided by N (the single "
                        "process keeps it): the chunk working set then shrinks with N too")
    p.add_argument("--profiler", action="store_true",
                   help="also ckpt_ext.peak_memory_bytes of a third step (for comparison)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from _harness import provenance
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                            text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    lines = [*provenance("cpu"), f"commit: {commit.strip()}",
             f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}",
             f"CKPT_EXT_CHUNK_BYTES: {os.environ.get('CKPT_EXT_CHUNK_BYTES', 'unset (64 MiB)')}",
             f"H {a.hidden}, I {a.intermediate}, {a.heads}/{a.kv_heads} heads, {a.layers} "
             f"layers, B {a.batch}, S {a.seq}, float32, {a.preset}, full weights with "
             f"gradients, {a.threads} torch thread(s) per process"]
    mib = 2.0 ** 20
    with tempfile.TemporaryDirectory() as tmp:
        one = run(1, a, tmp)[0]
        if a.scale_chunk_cap:
            from ckpt_ext import _C
            os.environ["CKPT_EXT_CHUNK_BYTES"] = str(_C.chunk_bytes() // a.world)
            lines.append(f"the {a.world} ranks: CKPT_EXT_CHUNK_BYTES="
                         f"{os.environ['CKPT_EXT_CHUNK_BYTES']} (the cap / N)")
        many = run(a.world, a, tmp)
    lines.append(f"1 process: heap peak {one['heap'] / mib:8.1f} MiB ({one['samples']} samples)"
                 + (f", profiler peak {one['profiler'] / mib:8.1f} MiB" if a.profiler else "")
                 + f", step {one['step_s']:.1f} s")
    for r, res in enumerate(many):
        lines.append(f"{a.world} ranks, rank {r}: heap peak {res['heap'] / mib:8.1f} MiB "
                     f"({res['samples']} samples)"
                     + (f", profiler peak {res['profiler'] / mib:8.1f} MiB" if a.profiler
                        else "") + f", step {res['step_s']:.1f} s")
    worst = max(res["heap"] for res in many)
    lines.append(f"ratio (largest rank / 1 process), heap: {worst / one['heap']:.3f}")
    lines.append(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
