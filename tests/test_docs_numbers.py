"""Figures quoted in README.md and docs/ checked against the files under bench/results/.

Three markers, HTML comments that Markdown and mkdocs leave out of the rendered page:

``<!-- src FILE :: REGEX -->FIGURE`` (optionally a unit after the regex, ``:: KiB``, ``:: MiB``,
    ``:: GiB``, ``:: ms`` or ``:: us``): FILE is a path under bench/results/; REGEX (Python ``re``, multiline) must match
    FILE exactly once, and its first group is the value. The figure is the first number after
    the marker (``**`` or spaces may sit between). With a unit, the value is bytes divided by
    1024, 1024**2 or 1024**3, or seconds shown in ms or us. The value, rounded to as many decimals as the figure
    shows, must equal the figure (thousands separators ignored).
``<!-- src-table FILE -->`` on the line before a Markdown table or a fenced code block: every
    line of that block must be a line of FILE (ends stripped). A table may quote some rows.
``<!-- calc EXPR -->FIGURE``: a figure derived from a formula (say bytes per token at some
    dims); EXPR is arithmetic (digits, + - * / ** and parentheses), compared as above.
``FIGURE ... <!-- src FILE :: REGEX [:: UNIT] @ FIGURE -->`` (or ``calc EXPR @ FIGURE``): the same
    checks, the marker at the end of the line (only other markers, spaces or a table's closing
    ``|`` after it) naming the figure it vouches for, which must occur exactly once in that
    line's prose before it. A reader of the raw Markdown in a terminal sees the sentence whole.

Outside code, a number with a unit of memory, time or ratio (``MiB``, ``KiB/token``, ``s``,
``minutes``, ``x``, ``%``, ``TFLOP/s``, ...) must carry one of these markers, so a measured
figure cannot enter the docs without its source. A setting or formula constant goes in a code
span. Every relative link in README.md must resolve to a file (and a heading, for ``#anchor``).
"""
import ast
import operator
import pathlib
import re
import unicodedata

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def doc_files():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


MARKER = re.compile(r"<!--\s*(src-table|src|calc)\s+(.*?)\s*-->", re.S)
FIGURE = re.compile(r"[\s*~]*(-?\d[\d,]*(?:\.\d+)?)")
UNITS = {"KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3, "ms": 1e-3, "us": 1e-6}
# A number with a unit that says "measured" (memory, time, a ratio, a rate).
MEASURED = re.compile(
    r"(?<![\w.,/-])(\d[\d,]*(?:\.\d+)?)(?:\s?(?:KiB/token|KiB|MiB|GiB|TiB|TFLOP/s|ms|us)\b"
    r"|\s(?:s|minutes?|seconds?)\b|x\b|%)")
FENCE = re.compile(r"^\s*```")


def rounded_equal(value, figure):
    """True when ``value`` rounded to the figure's decimals reads as ``figure``."""
    digits = figure.replace(",", "")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    return f"{float(value):.{decimals}f}" == digits


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg}


def arithmetic(expr):
    """Evaluate digits, + - * / ** and parentheses; anything else is a ValueError."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not plain arithmetic: {expr!r}")
    return ev(ast.parse(expr, mode="eval"))


def source_value(spec, results):
    """(value, error) for the body of a ``src`` marker: ``FILE :: REGEX [:: UNIT]``."""
    parts = [p.strip() for p in spec.split(" :: ")]
    if len(parts) not in (2, 3):
        return None, f"marker body {spec!r} is not 'FILE :: REGEX [:: UNIT]'"
    path = results / parts[0]
    if not path.is_file():
        return None, f"source {parts[0]} does not exist under bench/results/"
    try:
        matches = [m for m in re.finditer(parts[1], path.read_text(), re.M)]
    except re.error as e:
        return None, f"bad regex {parts[1]!r}: {e}"
    if len(matches) != 1:
        return None, f"regex {parts[1]!r} matches {len(matches)} times in {parts[0]} (needs 1)"
    raw = matches[0].group(1).replace(",", "")
    try:
        value = float(raw)
    except ValueError:
        return None, f"regex {parts[1]!r} captured {raw!r} in {parts[0]}, not a number"
    if len(parts) == 3:
        if parts[2] not in UNITS:
            return None, f"unknown unit {parts[2]!r} (one of {', '.join(UNITS)})"
        value /= UNITS[parts[2]]
    return value, None


def code_blocks(lines):
    """Indices of lines inside fenced code blocks (fences included)."""
    inside, out = False, set()
    for i, line in enumerate(lines):
        if FENCE.match(line):
            out.add(i)
            inside = not inside
        elif inside:
            out.add(i)
    return out


def code_span_masks(lines, code):
    """Per line, which characters sit inside inline code spans (which may cross lines of a
    paragraph but not a blank line); fenced lines are all code already."""
    text = "\n".join("" if i in code else line for i, line in enumerate(lines))
    mask = bytearray(len(text))
    for m in re.finditer(r"`(?:[^`\n]|\n(?![ \t]*\n))*?`", text):
        mask[m.start():m.end()] = b"\x01" * (m.end() - m.start())
    masks, pos = [], 0
    for i, line in enumerate(lines):
        n = 0 if i in code else len(line)
        masks.append(mask[pos:pos + n])
        pos += n + 1
    return masks


def block_after(lines, i):
    """The table or fenced block starting at the first non-empty line after line i."""
    j = i + 1
    while j < len(lines) and not lines[j].strip():
        j += 1
    if j < len(lines) and FENCE.match(lines[j]):
        k = j + 1
        while k < len(lines) and not FENCE.match(lines[k]):
            k += 1
        return list(range(j + 1, k)), set(range(j, k + 1))
    k = j
    while k < len(lines) and lines[k].lstrip().startswith("|"):
        k += 1
    return list(range(j, k)), set(range(j, k))


def trailing_figure(line, m, figure, prose):
    """(figure, error) for a line-end marker ``m`` that names ``figure``: the figure must occur
    once in the line's prose before the marker; that occurrence is taken out of ``prose``."""
    rest = MARKER.sub("", line[m.end():])
    if rest.strip(" \t|"):
        return None, f"a marker naming its figure ('@ {figure}') must end the line"
    if not re.fullmatch(r"-?\d[\d,]*(?:\.\d+)?", figure):
        return None, f"'@ {figure}' does not name a number"
    left = "".join(c if keep else " " for c, keep in zip(line[:m.start()], prose))
    hits = list(re.finditer(rf"(?<![\w.,]){re.escape(figure)}(?![\d]|[.,]\d)", left))
    if len(hits) != 1:
        return None, f"'@ {figure}' occurs {len(hits)} times in the line's prose (needs 1)"
    prose[hits[0].start():hits[0].end()] = bytes(hits[0].end() - hits[0].start())
    return figure, None


def check_text(text, results=RESULTS, name="<text>"):
    """Every problem with the quoted figures of one Markdown text, as strings."""
    problems, lines = [], text.split("\n")
    code = code_blocks(lines)
    spans = code_span_masks(lines, code)
    covered = set()                     # lines quoted verbatim by src-table markers
    for i, line in enumerate(lines):
        for m in MARKER.finditer(line):
            if m.group(1) != "src-table" or i in code or spans[i][m.start()]:
                continue
            where = f"{name}:{i + 1}"
            path = results / m.group(2)
            block, span = block_after(lines, i)
            covered |= span
            if not path.is_file():
                problems.append(f"{where}: source {m.group(2)} does not exist under bench/results/")
                continue
            if not block:
                problems.append(f"{where}: src-table marker with no table or code block after it")
                continue
            source = {s.strip() for s in path.read_text().split("\n")}
            for j in block:
                if lines[j].strip() not in source:
                    problems.append(f"{name}:{j + 1}: line not in {m.group(2)}: {lines[j].strip()!r}")
    for i, line in enumerate(lines):
        if i in code:
            continue
        where = f"{name}:{i + 1}"
        if re.match(r"\s*<!--\s*(src|calc)\s", line):
            problems.append(f"{where}: a marker starts the line, where Markdown reads an HTML "
                            "block; put a word of the sentence before it")
        prose = bytearray(1 - b for b in spans[i])      # 1: prose, 0: code span or marker
        for m in MARKER.finditer(line):
            kind = m.group(1)
            if not prose[m.start()]:
                continue                                 # a marker shown as code
            prose[m.start():m.end()] = bytes(m.end() - m.start())
            if kind == "src-table":
                continue
            body, at, named = m.group(2).rpartition(" @ ")
            if at:
                figure, err = trailing_figure(line, m, named.strip(), prose)
                if err:
                    problems.append(f"{where}: {err}")
                    continue
            else:
                body = m.group(2)
                fig = FIGURE.match(line, m.end())
                if not fig:
                    problems.append(f"{where}: {kind} marker not followed by a figure")
                    continue
                prose[m.end():fig.end()] = bytes(fig.end() - m.end())
                figure = fig.group(1)
            if kind == "src":
                value, err = source_value(body, results)
            else:
                try:
                    value, err = arithmetic(body), None
                except (ValueError, SyntaxError, ZeroDivisionError) as e:
                    value, err = None, f"calc {body!r}: {e}"
            if err:
                problems.append(f"{where}: {err}")
            elif not rounded_equal(value, figure):
                problems.append(f"{where}: quotes {figure} but {kind} {body!r} gives {value:g}")
        if i in covered:
            continue
        text_left = "".join(c if keep else " " for c, keep in zip(line, prose))
        text_left = re.sub(r"\]\([^)]*\)", "]", text_left)  # link targets
        for m in MEASURED.finditer(text_left):
            problems.append(f"{where}: figure {m.group(0)!r} without a src/calc marker")
    return problems


def test_quoted_figures_match_their_sources():
    problems = []
    for path in doc_files():
        problems += check_text(path.read_text(), name=str(path.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


def test_docs_quote_figures():
    # The check must have something to check: the README's headline is sourced.
    readme = (ROOT / "README.md").read_text()
    assert len(MARKER.findall(readme)) >= 3
    total = sum(len(MARKER.findall(p.read_text())) for p in doc_files())
    print(f"{total} markers in {len(doc_files())} files")
    assert total >= 20


@pytest.fixture
def results(tmp_path):
    (tmp_path / "run.csv").write_text(
        "# command: x\nsetup,seq,peak_bytes\nmin_memory,131072,53893006848\nhf_gc,32768,1\n"
        "| a | 1.5 |\n")
    return tmp_path


def test_a_changed_figure_is_detected(results):
    ok = "peak <!-- src run.csv :: ^min_memory,\\d+,(\\d+) :: GiB -->50.2 GiB at " \
         "<!-- src run.csv :: ^min_memory,(\\d+), -->**131,072** tokens"
    assert check_text(ok, results) == []
    for bad in (ok.replace("50.2", "50.3"), ok.replace("131,072", "131,073"),
                ok.replace("50.2", "50.1")):
        problems = check_text(bad, results)
        assert len(problems) == 1 and "quotes" in problems[0], problems


def test_a_changed_source_is_detected(results):
    ok = "at <!-- src run.csv :: ^hf_gc,(\\d+), -->32,768"
    assert check_text(ok, results) == []
    (results / "run.csv").write_text((results / "run.csv").read_text().replace("32768", "36864"))
    assert "quotes 32,768" in check_text(ok, results)[0]


def test_broken_markers_are_errors(results):
    cases = {
        "at <!-- src gone.csv :: (\\d+) -->1": "does not exist",
        "at <!-- src run.csv :: ^(\\w+), -->1": "matches 3 times",
        "at <!-- src run.csv :: ^min_memory,(\\d+), --> tokens": "not followed by a figure",
        "at <!-- src run.csv :: ^min_memory,(\\d+), :: PiB -->1": "unknown unit",
        "at <!-- calc 2*__import__('os') -->2": "not plain arithmetic",
        "at <!-- calc 2*4096 -->8,193 bytes": "quotes 8,193",
        "a step of 3.42 s": "without a src/calc marker",
        "1.06x the time": "without a src/calc marker",
        "a step of\n<!-- calc 2*4096 -->8,192 bytes": "starts the line",
        "peak 50.2 GiB": "without a src/calc marker",
    }
    for text, expected in cases.items():
        problems = check_text(text, results)
        assert len(problems) == 1 and expected in problems[0], (text, problems)
    # Figures in code spans and fenced blocks are not prose; LLaMA-3-8B is not a figure.
    assert check_text("`64MiB` and LLaMA-3-8B\n```\npeak 50.2 GiB\n```", results) == []
    assert check_text("at <!-- calc 2*4096 -->8,192 bytes", results) == []


def test_a_changed_table_row_is_detected(results):
    ok = "<!-- src-table run.csv -->\n| a | 1.5 |\n\ntext"
    assert check_text(ok, results) == []
    problems = check_text(ok.replace("1.5", "1.6"), results)
    assert len(problems) == 1 and "line not in run.csv" in problems[0]
    problems = check_text("<!-- src-table run.csv -->\n\nno table", results)
    assert "no table or code block" in problems[0]


def test_line_end_markers(results):
    ok = ("peak 50.2 GiB at **131,072** tokens <!-- src run.csv :: ^min_memory,\\d+,(\\d+) :: GiB "
          "@ 50.2 --><!-- src run.csv :: ^min_memory,(\\d+), @ 131,072 -->")
    assert check_text(ok, results) == []
    assert check_text("| a | 8,192 B <!-- calc 2*4096 @ 8,192 --> |", results) == []
    cases = {
        ok.replace("peak 50.2", "peak 50.3"): "occurs 0 times",
        ok.replace("@ 50.2", "@ 50.3"): "occurs 0 times",
        ok.replace("tokens <!--", "tokens, 131,072 again <!--"): "occurs 2 times",
        ok.replace(":: GiB @ 50.2 -->", ":: GiB @ 50.2 --> more"): "must end the line",
        "at 8,193 bytes <!-- calc 2*4096 @ 8,193 -->": "quotes 8,193",
        "at 8 GiB <!-- calc 2*4 @ GiB -->": "does not name a number",
        # a figure that only part of a larger number spells is not the figure
        "at 131,0725 <!-- src run.csv :: ^min_memory,(\\d+), @ 131,072 -->": "occurs 0 times",
    }
    for text, expected in cases.items():
        problems = check_text(text, results)
        assert any(expected in p for p in problems), (text, problems)


def test_a_changed_readme_figure_is_detected():
    """The real README: change the first sourced figure and the check must fail."""
    text = (ROOT / "README.md").read_text()
    m = next(m for m in MARKER.finditer(text) if m.group(1) == "src")
    named = m.group(2).rpartition(" @ ")[2].strip() if " @ " in m.group(2) else None
    if named:                           # a line-end marker: its figure sits earlier in the line
        line_start = text.rindex("\n", 0, m.start()) + 1
        start = text.index(named, line_start)
        end, figure = start + len(named), named
    else:
        fig = FIGURE.match(text, m.end())
        start, end = fig.span(1)
        figure = fig.group(1)
    last = figure[-1]
    changed = text[:end - 1] + ("1" if last != "1" else "2") + text[end:]
    assert check_text(text, name="README.md") == []
    problems = check_text(changed, name="README.md")
    assert len(problems) == 1, problems
    assert "occurs 0 times" in problems[0] if named else f"quotes {figure[:-1]}" in problems[0], \
        problems


def slug(heading):
    """The anchor Python-Markdown's toc extension (mkdocs) gives a heading."""
    text = heading.replace("`", "").replace("*", "")
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path):
    lines = path.read_text().split("\n")
    code = code_blocks(lines)
    return {slug(re.sub(r"^#+\s*", "", l)) for i, l in enumerate(lines)
            if l.startswith("#") and i not in code}


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [l for l in links if not re.match(r"[a-z]+:", l)]
    assert any(l.startswith("docs/") for l in relative), "the README links no page of docs/"
    broken = []
    for link in relative:
        target, _, anchor = link.partition("#")
        path = ROOT / target if target else ROOT / "README.md"
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{link}: no heading with that anchor in {target or 'README.md'}")
    assert not broken, "\n".join(broken)


def test_slug_follows_mkdocs():
    assert slug("Presets and planning") == "presets-and-planning"
    assert slug("The `min_memory` preset, on an H100") == "the-min_memory-preset-on-an-h100"


def load_presets():
    """ckpt_ext.presets: its per-token bytes read the engine's residual layout
    (ckpt_ext._C.layer_residuals), so the built extension is needed (the reason is printed)."""
    try:
        from ckpt_ext import presets
    except ImportError as e:
        pytest.skip(f"the package's formula reads the built extension: {e}")
    return presets


def formula_rows(path):
    """{preset: python expression} from a Markdown table row ``| `preset` | ... | `formula` |``."""
    rows = {}
    for line in path.read_text().split("\n"):
        m = re.match(r"\| `(\w+)` \|.*\| `([^`]+)` \|$", line)
        if m:
            expr = m.group(2).replace("·", "*")
            expr = re.sub(r"(\d)([A-Za-z(])", r"\1*\2", expr)        # 2e -> 2*e, 2I -> 2*I
            rows[m.group(1)] = expr
    return rows


@pytest.mark.parametrize("page", ["README.md", "docs/presets.md"])
def test_preset_formulas_are_the_package_s(page):
    torch = pytest.importorskip("torch", reason="the preset formulas are computed with torch dtypes")
    presets = load_presets()
    rows = formula_rows(ROOT / page)
    assert set(rows) == {"torch", "fast", "balanced", "min_memory"}, rows
    dims = [dict(H=4096, Hq=32, Hkv=8, D=128, I=14336), dict(H=512, Hq=8, Hkv=2, D=64, I=1376),
            dict(H=2304, Hq=8, Hkv=4, D=256, I=9216)]
    for d in dims:
        for dtype, compute in [(torch.bfloat16, None), (torch.float32, None),
                               (torch.float32, torch.bfloat16)]:
            e = torch.empty((), dtype=dtype).element_size()
            c = torch.empty((), dtype=compute or dtype).element_size()
            for preset, expr in rows.items():
                written = arithmetic_with(expr, dict(d, e=e, c=c))
                package = presets.per_token_bytes(preset, dtype=dtype, compute_dtype=compute, **d)
                assert written == package, (page, preset, expr, d, dtype, compute)


def arithmetic_with(expr, names):
    for name in sorted(names, key=len, reverse=True):
        expr = re.sub(rf"\b{name}\b", str(names[name]), expr)
    return arithmetic(expr)


def test_a_changed_formula_is_detected():
    presets = load_presets()
    import torch
    d = dict(H=4096, Hq=32, Hkv=8, D=128, I=14336)
    right = arithmetic_with("2*e*H + c*Hq*D + 4*Hq", dict(d, e=2, c=2))
    wrong = arithmetic_with("2*e*H + c*Hq*D", dict(d, e=2, c=2))
    package = presets.per_token_bytes("balanced", dtype=torch.bfloat16, **d)
    assert right == package != wrong
