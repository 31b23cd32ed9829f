"""The GPU run's prepared call (``tools/gpu_validate.sh quick``) dry-run on the CPU.

A lent GPU comes for 15 minutes, one call of at most 10; a typo, a renamed flag or entry point
in that call would waste it. ``quick --dry-run`` runs every part with the GPU's own arguments
followed by tiny sizes (argparse takes the last, so a flag that no longer exists still fails),
on the CPU: the probe's aten calls on meta tensors and the CPU flash kernel, the GPU-marked
and offload CUDA tests (which skip here with their reasons), the long step and its plan
figures, the attention backends, the LoRA profile, the layer at "256K", the demo. These tests
check that every part ran to the end and left what the GPU run's reader needs: the files
(8 at most, each with device, versions, command and date), the probe's one line per op and
question, measured / modelled beside each other, the summary.
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_validate.sh"
FILES = {"quick_0_summary.txt", "quick_a_sdpa_probe.txt", "quick_b_gpu_tests.txt",
         "quick_cf_long_step.txt", "quick_d_attention.txt", "quick_e_lora_profile.txt",
         "quick_g_demo.txt", "quick_g_demo.png"}
PROBE_OPS = ("flash", "cudnn", "efficient", "flash_varlen", "efficient_varlen", "varlen_attn",
             "cpu_flash")
QUESTIONS = ("meta", "mha", "gqa", "gqa_bwd", "causal_sq<sk", "empty_rows", "fp32")


def _env(out):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env.update(OUT=str(out), PYTHON=sys.executable)
    return env


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_quick")
    try:
        proc = subprocess.run(["bash", str(SCRIPT), "quick", "--dry-run"], cwd=ROOT,
                              env=_env(out), capture_output=True, text=True, timeout=1200)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the dry run did not end in 20 minutes; its output so far:\n"
                    f"{(exc.stdout or b'')[-4000:]}")
    return proc, out


def _read(out, name):
    return (out / name).read_text()


def _part_alone(out, part, timeout=300):
    """``quick --dry-run --parts <part>`` into out: its exit status 0, the summary (from its
    heading on), with the part ok and no other part's line."""
    proc = subprocess.run(["bash", str(SCRIPT), "quick", "--dry-run", "--parts", part],
                          cwd=ROOT, env=_env(out), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    summary = proc.stdout[proc.stdout.index("gpu_validate quick: summary"):]
    assert re.search(rf"^{part} ok ", summary, re.M), summary
    others = "".join(sorted(set("abcdefgmqst") - {part}))
    assert not re.search(rf"^[{others}] (ok|FAILED|TIMEOUT|SKIPPED)", summary, re.M), summary
    return summary


def test_unknown_argument_refused(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "quick", "--dryrun"], cwd=ROOT,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unknown argument '--dryrun'" in proc.stdout


def test_every_part_runs_to_the_end(dry_run):
    proc, out = dry_run
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    summary = proc.stdout[proc.stdout.index("gpu_validate quick: summary"):]
    for part in "abcdefg":
        assert re.search(rf"^{part} ok ", summary, re.M), f"part {part} not ok:\n{summary}"
    assert "build skipped (dry run" in proc.stdout
    # the summary is also the last thing in quick_0_summary.txt
    assert _read(out, "quick_0_summary.txt").rstrip().endswith(summary.rstrip().splitlines()[-1])


def test_files_at_most_eight_each_with_provenance(dry_run):
    proc, out = dry_run
    names = {p.name for p in out.iterdir()}
    assert len(names) <= 8, names
    expected = set(FILES)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib not importable: the demo writes no plot, so quick_g_demo.png is "
              "not expected")
        expected.discard("quick_g_demo.png")
    assert names == expected, proc.stdout[-3000:]
    for name in sorted(names - {"quick_g_demo.png"}):
        text = _read(out, name)
        assert text.startswith("# device: CPU dry run"), (name, text[:300])
        for field in ("# versions: torch ", "# git: ", "# command: ", "# date: 20"):
            assert field in text, (name, field)
    # parts c and f share a file: two headers, two commands
    cf = _read(out, "quick_cf_long_step.txt")
    assert cf.count("# command: ") >= 2 and "# part c:" in cf and "# part f:" in cf


def test_probe_one_line_per_op_and_question(dry_run):
    _, out = dry_run
    text = _read(out, "quick_a_sdpa_probe.txt")
    for op in PROBE_OPS:
        for q in QUESTIONS:
            lines = re.findall(rf"^{re.escape(op)} +{re.escape(q)} +(.+)$", text, re.M)
            assert len(lines) == 1, (op, q, lines)
    # the CUDA ops' calls as the probe makes them, checked by their meta kernels here
    for op in ("flash", "cudnn", "efficient", "flash_varlen", "efficient_varlen"):
        line = re.search(rf"^{op} +meta +(.+)$", text, re.M).group(1)
        assert line.startswith("meta kernel: out (2, 4, 32, 16), lse ("), (op, line)
    # and the CPU flash kernel answers every question: its alignment is top-left
    assert re.search(r"^cpu_flash +causal_sq<sk +top-left ", text, re.M), text
    assert re.search(r"^cpu_flash +gqa +accepted, right", text, re.M), text
    assert re.search(r"^cpu_flash +mha +ok .*lse \(2, 4, 32\) float32, natural log", text,
                     re.M), text


def test_gpu_tests_collected_and_skipped_with_reasons(dry_run):
    _, out = dry_run
    text = _read(out, "quick_b_gpu_tests.txt")
    # both runs collected tests (a renamed marker or file would collect none: exit 5)
    ends = re.findall(r"^=*\s*(\d+) skipped.* in [\d.]+s", text, re.M)
    assert len(ends) == 2 and all(int(n) > 0 for n in ends), text[-2000:]
    assert "needs a CUDA GPU" in text
    assert "tests/test_offload.py" in text


def test_long_step_measured_beside_modelled(dry_run):
    _, out = dry_run
    text = _read(out, "quick_cf_long_step.txt")
    for setup in ("min_memory", "min_memory+offload"):
        assert re.search(rf"^{re.escape(setup)} +peak [\d.e+-]+ GiB / modelled [\d.e+-]+ GiB = "
                         rf"[\d.]+ ", text, re.M), (setup, text)
        assert re.search(rf"^{re.escape(setup)} +step +[\d.]+ s \(first", text, re.M), setup
    assert re.search(r"host [\d.e+-]+ GiB / modelled [\d.e+-]+ = [\d.]+", text)
    # where the plan puts the peak, beside the figure (the head's backward or a layer's)
    assert re.search(r"^min_memory +peak .*\(the plan's peak: (head backward|top layer "
                     r"backward)", text, re.M), text
    assert "min_memory: step time offload/none" in text
    # part f: one 2-layer segment, streamed inputs
    assert "2 layers, B 1, S 256" in text and "2 layers, B 1, S 128" in text
    assert re.search(r"^min_memory\+offload\+stream\+seg2 +peak [\d.e+-]+ GiB / modelled "
                     r"[\d.e+-]+ GiB = [\d.]+ .*plan's pool 0\)", text, re.M), text
    assert "OOM" not in text


def test_attention_backends_rows(dry_run):
    _, out = dry_run
    text = _read(out, "quick_d_attention.txt")
    assert "CKPT_EXT_AUTOTUNE=1" in text
    # the routing's bench: the op with each backend pinned, then its CSV and choice table
    assert "bench/attention.py --backend-rows" in text
    # Triton is timed under each dQ mode (table format 2), each its own row and CSV line
    for mode in ("separate", "ordered", "atomic"):
        assert re.search(rf"^ +triton:{mode} Sq=64 Sk=64 q_offset=0: fwd [\d.]+ ms", text,
                         re.M), (mode, text)
        assert re.search(rf"^triton:{mode},triton,fwd\+bwd,1,4,2,16,64,64,0,", text, re.M), mode
    for backend in ("flash", "cudnn", "efficient"):
        assert re.search(rf"^ +{backend} Sq=16 Sk=64 q_offset=48: ", text, re.M), backend
    # the layer's own calls (6 rows per chunk at the dry run's tiny dims and 16 KiB cap):
    # its first, middle and last chunk, each against the keys it sees
    for sq, sk, off in ((6, 6, 0), (6, 36, 30), (4, 64, 60)):
        assert re.search(rf"^ +triton:ordered Sq={sq} Sk={sk} q_offset={off}: fwd [\d.]+ ms",
                         text, re.M), (sq, sk, text)
        assert re.search(rf"^triton:ordered,triton,fwd\+bwd,1,4,2,16,{sq},{sk},{off},.*,"
                         rf"layer S 64: chunk \d+/11 of 6 rows", text, re.M), (sq, sk)
    # each shape again packed (documents of 24 tokens as segment ids), its own table rules
    assert re.search(r"^ +triton:atomic Sq=64 Sk=64 q_offset=0 packed 24: fwd [\d.]+ ms", text,
                     re.M)
    assert re.search(r"^triton:atomic,triton,fwd\+bwd,1,4,2,16,64,64,0,float32,True,packed 24,",
                     text, re.M), text
    assert '"rules"' in text and '"masks": "packed"' in text


def test_lora_profile_every_row(dry_run):
    _, out = dry_run
    text = _read(out, "quick_e_lora_profile.txt")
    for row in ("none", "fast", "balanced", "min_memory", "hf", "hf@lora", "fast@lora",
                "balanced@lora", "min_memory@lora"):
        assert re.search(rf"^== {re.escape(row)}: step [\d.]+ ms", text, re.M), row
    for preset in ("fast", "balanced", "min_memory"):
        assert re.search(rf"^LoRA increment {preset} ", text, re.M), preset
    assert "goal fast@lora <= hf@lora" in text
    assert "Self CPU time total" in text        # the profiler's tables


def test_demo_ran_and_left_bench_results_alone(dry_run):
    _, out = dry_run
    text = _read(out, "quick_g_demo.txt")
    assert re.search(r"^min_memory,", text, re.M), text[-2000:]   # its CSV, appended
    # the dry run writes the demo's files to a folder of its own: bench/results keeps the
    # committed demo_cpu.* untouched
    status = subprocess.run(["git", "status", "--porcelain", "bench/results"], cwd=ROOT,
                            capture_output=True, text=True)
    if status.returncode != 0:
        print(f"git status failed ({status.stderr.strip()}): bench/results not checked")
        return
    assert "demo_cpu" not in status.stdout, status.stdout


# ---- part s: the attention backward sweep, the second call's part (--parts s) -----------------
@pytest.fixture(scope="module")
def sweep_dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_quick_s")
    try:
        proc = subprocess.run(["bash", str(SCRIPT), "quick", "--dry-run", "--parts", "s"],
                              cwd=ROOT, env=_env(out), capture_output=True, text=True,
                              timeout=600)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the part s dry run did not end in 10 minutes; its output so far:\n"
                    f"{(exc.stdout or b'')[-4000:]}")
    return proc, out


def test_parts_argument_refuses_other_letters(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "quick", "--dry-run", "--parts", "ax"],
                          cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--parts takes letters among abcdefgmqst, got 'ax'" in proc.stdout


def test_parts_whose_files_pass_eight_refused(tmp_path):
    """The default list returns 8 files; the speed table's part with it would return 9, which
    the device tool would not bring back: refused before anything runs."""
    proc = subprocess.run(["bash", str(SCRIPT), "quick", "--dry-run", "--parts", "abcdefgt"],
                          cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--parts abcdefgt would return 9 files, more than the device tool's 8" in proc.stdout
    assert not list(tmp_path.iterdir())


def test_sweep_part_alone_writes_a_winners_file(sweep_dry_run):
    from ckpt_ext.kernels import attention_tuning as tuning

    proc, out = sweep_dry_run
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    summary = proc.stdout[proc.stdout.index("gpu_validate quick: summary"):]
    assert re.search(r"^s ok ", summary, re.M), summary
    # only part s ran: no other part's line or section
    assert not re.search(r"^[abcdefgmq] (ok|FAILED|TIMEOUT|SKIPPED)", summary, re.M), summary
    assert "-- a:" not in summary and "-- s: attention backward sweep" in summary
    names = {p.name for p in out.iterdir()}
    assert names == {"quick_0_summary.txt", "quick_s_attention_bwd.txt",
                     "quick_s_attention_bwd_configs.json"}, names
    log = _read(out, "quick_s_attention_bwd.txt")
    assert log.startswith("# device: CPU dry run") and "--parts s" in _read(
        out, "quick_0_summary.txt")
    # the winners file: the reader's format, provenance headers, one entry per kernel and
    # bucket (the whole 48 and the chunk 16 of 48, dK/dV accumulated there)
    w = tuning.load_winners(out / "quick_s_attention_bwd_configs.json")
    assert "bench/attention_bwd_sweep.py" in w.headers["command"]
    assert "Triton interpreter" in w.headers["machine"] and w.headers["date"].startswith("20")
    got = {(e.kernel, e.sq, e.sk, e.accumulate) for e in w.entries}
    assert got == {("dkdv", 48, 48, False), ("dq", 48, 48, None), ("dkdv", 16, 48, True),
                   ("dq", 16, 48, None)}, got
    for e in w.entries:
        assert e.ms > 0 and e.baseline_ms > 0 and e.dtype == "fp32" and e.head_dim == 16
        assert re.search(rf"^winner {e.kernel} Sq={e.sq} Sk={e.sk}.*: {e.config.label} ", log,
                         re.M), (e, log[-3000:])
    # every timed candidate was checked against the usual launch, none wrong
    assert re.findall(r"max rel err ([\d.e+-]+)", log) and "WRONG" not in log
    assert re.search(r"^check Sq=40 Sk=40: winners / baseline = [\d.]+$", log, re.M), log


# ---- part q: the attention under each dQ setting (--parts q) ----------------------------------
def test_dq_modes_part_alone(tmp_path):
    """--parts q: bench/attention.py with the three Triton providers (dQ separate, atomic,
    ordered) at the CPU smoke size: each provider's fwd, bwd and fwd+bwd rows in the CSV, the
    table in the summary, then the ordered provider alone under autotuning; no other part
    ran."""
    summary = _part_alone(tmp_path, "q")
    assert "-- q: TFLOP/s" in summary and re.search(r"^ +16 +2/1 +1 +32 ", summary, re.M)
    assert {p.name for p in tmp_path.iterdir()} == {"quick_0_summary.txt",
                                                   "quick_q_dq_modes.txt"}
    log = _read(tmp_path, "quick_q_dq_modes.txt")
    assert log.startswith("# device: CPU dry run") and "CKPT_EXT_AUTOTUNE=0" in log
    for provider in ("triton", "triton_atomic", "triton_ordered"):
        for mode in ("fwd", "bwd", "fwd+bwd"):
            assert re.search(rf"^{provider},{re.escape(mode)},16,2,1,1,32,,float32,True,"
                             r"[\d.]+,[\d.e+-]+,$", log, re.M), (provider, mode, log[-2000:])
    # then the ordered kernel alone, autotuned
    tuned = log[log.rindex("# triton_ordered autotuned (CKPT_EXT_AUTOTUNE=1)"):]
    assert re.search(r"^triton_ordered,bwd,16,2,1,1,32,,", tuned, re.M), tuned[-2000:]
    assert not re.search(r"^triton(_atomic)?,", tuned, re.M)


# ---- part m: the MoE layer, a second call's part (--parts m) ------------------------------------
def test_moe_layer_part_alone(tmp_path):
    """--parts m: bench/moe.py --layer at a small shape on the CPU (the GPU's code path in fp32):
    every row (HF's layer and the fused presets) with its time, peak and difference from HF's
    output and gradients (small), Liger's goal line, the CSV in the part's file, the summary's
    section; then the same with --expert-lora-rank (PEFT LoRA on the attention and the experts:
    the difference over the output, dx and every adapter's gradient); no other part ran."""
    summary = _part_alone(tmp_path, "m")
    assert "-- m: MoE layer" in summary and "goal (Liger's fused MoE" in summary
    assert {p.name for p in tmp_path.iterdir()} == {"quick_0_summary.txt",
                                                   "quick_m_moe_layer.txt"}
    log = _read(tmp_path, "quick_m_moe_layer.txt")
    assert log.startswith("# device: CPU dry run")
    errs = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"^ *(hf|fast|balanced|min_memory): .*max rel err vs hf \(y, dx, d router\) "
        r"([\d.e+-]+)$", log, re.M)}
    assert set(errs) == {"hf", "fast", "balanced", "min_memory"}, log[-3000:]
    assert errs["hf"] == 0 and all(e < 1e-4 for e in errs.values()), errs
    assert len(re.findall(r"^row,seq,peak_mib,step_s,rel_err_vs_hf$", log, re.M)) == 2, \
        log[-2000:]
    # the expert LoRA run: its rows, each fused one near HF's (an adapter the op skipped
    # would leave its gradient None, and the row would fail)
    lora = log[log.index("tokens, LoRA r 4 on attention and experts"):]
    errs = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"^ *(hf|fast|balanced|min_memory): .*max rel err vs hf \(y, dx, d adapters\) "
        r"([\d.e+-]+)$", lora, re.M)}
    assert set(errs) == {"hf", "fast", "balanced", "min_memory"}, lora[-3000:]
    assert errs["hf"] == 0 and all(e < 1e-4 for e in errs.values()), errs
    assert "LoRA r 4 on attention and experts" in summary
    assert summary.count("goal (Liger's fused MoE") == 2, summary


# ---- part t: the speed table (--parts t, or e.g. --parts bcet) ---------------------------------
def test_speed_table_part_alone(tmp_path):
    """--parts t: bench/speed.py with the GPU's arguments and --dry-run (the CPU, tiny sizes):
    every row (HF without and with checkpointing, + the fused loss, the presets, auto; each
    with LoRA) at both lengths, its CSV in the part's file, the tables and goals in the
    summary; no other part ran, two files."""
    summary = _part_alone(tmp_path, "t")
    assert {p.name for p in tmp_path.iterdir()} == {"quick_0_summary.txt", "quick_t_speed.txt"}
    log = _read(tmp_path, "quick_t_speed.txt")
    assert log.startswith("# device: CPU dry run")
    assert "bench/speed.py --seqs 4096,16384 --warmup 1 --reps 3 --dry-run --deadline" in log
    rows = re.findall(r"^([a-z_+@]+),[a-z_+]+,[01],(\d+),ok,[\d.e+-]+,[\d.e+-]+,", log, re.M)
    names = {s + x for x in ("", "@lora") for s in ("hf", "hf_gc", "hf_gc+fused_loss", "fast",
                                                     "balanced", "min_memory", "auto")}
    assert set(rows) == {(n, s) for n in names for s in ("32", "64")}, log[-3000:]
    assert "-- t: speed table" in summary
    for s in (32, 64):
        assert f"== S {s}: step ms and peak MiB" in summary
        assert re.search(rf"^hf_gc\+fused_loss@lora +ok +[\d.]+ +[\d.]+$", summary, re.M)
        assert re.search(rf"^goal S={s}: fast / hf = ", summary, re.M), summary
