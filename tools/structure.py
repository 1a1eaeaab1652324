#!/usr/bin/env python3
"""Counts what the structure issue measures in the Rust sources: functions over 100 lines, and
hand-written op lists (five or more `Op::` variants listed together: a match arm's alternatives,
a `matches!` pattern, an array), outside the classification.

    python3 tools/structure.py [--list] [--limit N] [--ops N] [PATH ...]

PATH defaults to the crates' sources (src, ir/src, passes/src, runtime/src). `--list` prints each
function and list found; the last lines are the counts. Tests (`tests/`, `#[cfg(test)]` modules)
are counted apart. Standard library only.
"""
import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ["src", "ir/src", "passes/src", "runtime/src", "python/src"]
FN = re.compile(r"^(\s*)(?:pub(?:\([^)]*\))?\s+)?(?:const\s+|unsafe\s+|async\s+|extern\s+\"C\"\s+)*fn\s+(\w+)")
# An `Op::` variant, with its fields or payload as a pattern may write them.
VARIANT = r"Op::\w+(?:\s*\((?:[^()]|\([^()]*\))*\)|\s*\{[^{}]*\})?"
RUN = re.compile(VARIANT + r"(?:\s*[|,]\s*" + VARIANT + r")+")


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return "\n".join(re.sub(r"//.*$", "", line) for line in text.split("\n"))


def test_ranges(lines):
    """Line ranges of `#[cfg(test)] mod ... { }` blocks."""
    out = []
    for i, line in enumerate(lines):
        if line.strip() == "#[cfg(test)]" and i + 1 < len(lines) and re.match(r"\s*(pub\s+)?mod\s+\w+\s*\{", lines[i + 1]):
            indent = len(lines[i + 1]) - len(lines[i + 1].lstrip())
            for j in range(i + 2, len(lines)):
                if lines[j].startswith(" " * indent + "}") and len(lines[j]) - len(lines[j].lstrip()) == indent:
                    out.append((i, j))
                    break
    return out


def functions(lines):
    """(name, first line, length) of every fn with a body, by the closing brace at its indent."""
    out = []
    for i, line in enumerate(lines):
        m = FN.match(line)
        if not m:
            continue
        indent = m.group(1)
        # A declaration without a body (a trait's) ends with `;` before any `{`.
        j = i
        while j < len(lines) and "{" not in lines[j] and not lines[j].rstrip().endswith(";"):
            j += 1
        if j >= len(lines) or "{" not in lines[j]:
            continue
        if lines[j].rstrip().endswith("}") and lines[j].count("{") == lines[j].count("}"):
            out.append((m.group(2), i + 1, j - i + 1))
            continue
        for k in range(j + 1, len(lines)):
            if lines[k].startswith(indent + "}") and len(lines[k]) - len(lines[k].lstrip()) == len(indent):
                out.append((m.group(2), i + 1, k - i + 1))
                break
    return out


def op_lists(text, at_least):
    """(line, variants) of every run of `at_least` or more `Op::` variants joined by `|` or `,`."""
    out = []
    for m in RUN.finditer(text):
        n = len(re.findall(r"Op::\w+", m.group(0)))
        if n >= at_least:
            out.append((text[: m.start()].count("\n") + 1, n))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--limit", type=int, default=100, help="lines a function may have")
    ap.add_argument("--ops", type=int, default=5, help="variants that make a hand op list")
    ap.add_argument("--skip", default="classify", help="files of the classification (by name part)")
    a = ap.parse_args()
    files = []
    for p in a.paths or DEFAULT:
        p = ROOT / p
        files += [p] if p.is_file() else sorted(p.rglob("*.rs"))
    long_fns, lists, long_test_fns = [], [], []
    for f in files:
        raw = f.read_text()
        text = strip_comments(raw)
        lines = text.split("\n")
        tests = test_ranges(lines)
        in_test = lambda line: any(a <= line - 1 <= b for a, b in tests)
        rel = f.relative_to(ROOT)
        for name, line, n in functions(lines):
            if n > a.limit:
                (long_test_fns if in_test(line) else long_fns).append((n, f"{rel}:{line}", name))
        if a.skip and a.skip in f.name:
            continue
        for line, n in op_lists(text, a.ops):
            if not in_test(line):
                lists.append((n, f"{rel}:{line}"))
    if a.list:
        for n, where, name in sorted(long_fns, reverse=True):
            print(f"fn {name}: {n} lines ({where})")
        for n, where in sorted(lists, reverse=True):
            print(f"op list of {n} variants ({where})")
    print(f"functions over {a.limit} lines: {len(long_fns)} (in #[cfg(test)] modules: {len(long_test_fns)})")
    print(f"hand op lists ({a.ops}+ variants together): {len(lists)}")


if __name__ == "__main__":
    sys.exit(main())
