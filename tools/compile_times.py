"""CPU time of each compile of the C++ extension, one compile at a time.

A parallel build's wall times (``.ninja_log``) grow with the machine's load; the CPU time a
compiler process spends (user + system, from ``wait4``) barely does. This script takes the
compile commands of the last build (``ninja -t commands`` in the build's object folder, so
the flags are exactly the build's), runs them one after another into a temporary folder (the
build's own objects are left alone) and prints, per source, the CPU time and the wall time.

With ``--ref COMMIT`` the same commands also compile that commit's ``csrc/`` (extracted with
``git archive``), file by file alternating with the working tree, so that both see the same
load, and the table compares them.

    python tools/compile_times.py                       # working tree
    python tools/compile_times.py --ref main --repeat 2 # main's csrc/ against the working tree
    python tools/compile_times.py --ninja-log           # the last build's .ninja_log, per file

Needs a build first (``pip install --no-build-isolation -e .``), for ``build.ninja``.
"""
import argparse
import datetime
import glob
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_EXTS = (".cpp", ".cu")


def build_temp(path):
    if path:
        return path
    found = sorted(glob.glob(os.path.join(ROOT, "build", "temp.*", "build.ninja")))
    if not found:
        sys.exit("compile_times: no build/temp.*/build.ninja; build the extension first")
    return os.path.dirname(found[-1])


def compile_commands(temp):
    """{source path relative to ROOT: argv} for every compile in the build."""
    out = subprocess.run(["ninja", "-C", temp, "-t", "commands"], check=True,
                         capture_output=True, text=True).stdout
    commands = {}
    for line in out.splitlines():
        argv = shlex.split(line)
        if "-c" not in argv or "-o" not in argv:
            continue  # the link
        sources = [a for a in argv if a.endswith(SOURCE_EXTS) and os.path.isabs(a)]
        if len(sources) != 1:
            continue
        commands[os.path.relpath(sources[0], ROOT)] = argv
    return commands


def retarget(argv, source, objdir):
    """argv compiling `source` into objdir (the dependency file too)."""
    argv = list(argv)
    for i, a in enumerate(argv):
        if a.endswith(SOURCE_EXTS) and os.path.isabs(a):
            argv[i] = source
        elif i > 0 and argv[i - 1] in ("-o", "-MF"):
            argv[i] = os.path.join(objdir, os.path.basename(a))
    return argv


def timed(argv):
    """(cpu seconds, wall seconds) of one command; exits on a failed compile."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    # wait4 reaped the child: tell Popen, so that it does not wait for it again.
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.stderr.write(err.decode(errors="replace")[-4000:])
        sys.exit(f"compile_times: {argv[-1] if argv else argv} failed")
    # The CPU time of the compiler and of every process it waited for (cc1plus, as).
    return usage.ru_utime + usage.ru_stime, wall


def load():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def git(*args, cwd=ROOT):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def header(args):
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "csrc", "setup.py"],
                           cwd=ROOT).returncode != 0
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return [
        f"# command: python tools/compile_times.py {' '.join(args)}".rstrip(),
        f"# commit: {git('rev-parse', '--short', 'HEAD')}"
        + (" + uncommitted changes in csrc/ or setup.py" if dirty else ""),
        f"# machine: {cpu}, {os.cpu_count()} cores; "
        f"{subprocess.run(['c++', '--version'], capture_output=True, text=True).stdout.splitlines()[0]}",
        f"# date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
    ]


def ninja_log(temp):
    """Per-file durations of the last build, from ninja's log (start and end in ms)."""
    rows = {}
    with open(os.path.join(temp, ".ninja_log")) as f:
        for line in f:
            if line.startswith("#"):
                continue
            start, end, _, path = line.split("\t")[:4]
            rows[path] = (int(start), int(end))  # later entries replace earlier ones
    print(f"# {os.path.join(temp, '.ninja_log')}: {len(rows)} outputs; wall ms per file")
    for path, (start, end) in sorted(rows.items(), key=lambda kv: kv[1]):
        print(f"{os.path.relpath(path, temp):44s} {start:>9d} {end:>9d} {end - start:>9d}")
    print(f"{'first start to last end':44s} {'':>9s} {'':>9s} "
          f"{max(e for _, e in rows.values()) - min(s for s, _ in rows.values()):>9d}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-temp", help="the build's object folder (default build/temp.*)")
    ap.add_argument("--ref", help="also compile this commit's csrc/, alternating with the tree")
    ap.add_argument("--repeat", type=int, default=1, help="compiles per file (median kept)")
    ap.add_argument("--only", nargs="*", help="these sources only (paths as csrc/x.cpp)")
    ap.add_argument("--ninja-log", action="store_true", help="print the last build's log")
    args = ap.parse_args()
    temp = build_temp(args.build_temp)
    if args.ninja_log:
        ninja_log(temp)
        return
    commands = compile_commands(temp)
    if args.only:
        commands = {k: v for k, v in commands.items() if k in args.only}
    print("\n".join(header(sys.argv[1:])))
    with tempfile.TemporaryDirectory(prefix="ckpt_ext_compile_times_") as tmp:
        trees = [("tree", ROOT)]
        if args.ref:
            ref_root = os.path.join(tmp, "ref")
            os.makedirs(ref_root)
            archive = subprocess.run(["git", "archive", args.ref, "csrc"], cwd=ROOT, check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", ref_root], input=archive, check=True)
            trees.insert(0, (f"ref {git('rev-parse', '--short', args.ref)}", ref_root))
        print(f"# load average at start: {load()}")
        print("# cpu s: user + system of the compiler; wall s: its wall time; one compile at a "
              f"time, median of {args.repeat}")
        names = [n for n, _ in trees]
        print(f"{'source':36s}" + "".join(f" {n + ' cpu s':>16s} {'wall s':>8s}" for n in names))
        totals = {n: [0.0, 0.0] for n in names}
        for src, argv in sorted(commands.items()):
            got = {n: [] for n in names}
            for _ in range(args.repeat):
                for name, root in trees:
                    path = os.path.join(root, src)
                    if not os.path.exists(path):
                        continue
                    got[name].append(timed(retarget(argv, path, tmp)))
            cells = []
            for name in names:
                if not got[name]:
                    cells.append(f" {'-':>16s} {'-':>8s}")
                    continue
                cpu = sorted(c for c, _ in got[name])[len(got[name]) // 2]
                wall = sorted(w for _, w in got[name])[len(got[name]) // 2]
                totals[name][0] += cpu
                totals[name][1] += wall
                cells.append(f" {cpu:>16.1f} {wall:>8.1f}")
            print(f"{src:36s}" + "".join(cells), flush=True)
        print(f"{'total':36s}" + "".join(f" {totals[n][0]:>16.1f} {totals[n][1]:>8.1f}"
                                         for n in names))
        print(f"# load average at end: {load()}")


if __name__ == "__main__":
    main()
