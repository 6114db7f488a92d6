#!/usr/bin/env python3
"""Code-writing prompts from the docstrings of the running Python's standard library.

ShareGPT holds about 2 000 code prompts, all used by the Qwen drafter's training; this makes
thousands more in the same domain (write a function or class that does what its docstring
says) from text every machine already has. Only the prompts are written (JSONL `{"prompt": …}`);
the target answers them itself (`dspark data regenerate`), and `dspark data prompts --from FILE
--append` filters them against every benchmark before they join a training prompt file. The
standard library's docstrings are under the PSF licence; the prompts are not committed, the answers the
target gave them are (data/train/README.md, with the licence notice).

Usage: scripts/stdlib_code_prompts.py OUT.jsonl [--seed 0] [--root DIR] [--skip-dir NAME ...]

`--root` reads another source tree instead, e.g. a permissively licensed package unpacked from
PyPI (`pip download --no-deps --no-binary :all: sympy`, then its folder): more prompts in the
same domain once the standard library's are all answered. Record the package and its licence in
data/train/README.md when its answers are committed. `--skip-dir` leaves out folders of that
name as well, e.g. the code a package vendors from other projects, so that its prompts are its own.
"""
import argparse
import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

# Packages that are tests, GUIs, or code generators: their docstrings describe the test suite or
# a widget, not a function someone would ask to be written.
SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
             "site-packages", "dist-packages", "pydoc_data", "__pycache__"}

TEMPLATES = [
    "Write a Python function `{sig}`.\n\n{doc}",
    "Implement `{sig}` in Python. {summary}",
    "{summary}\n\nWrite this as a Python function named `{name}` and explain how it works.",
    "How would I write a function `{name}` in Python that does the following?\n{doc}",
    "Write a Python function `{name}` with this docstring, including type hints and an example:\n\"\"\"{doc}\"\"\"",
]
CLASS_TEMPLATES = [
    "Write a Python class `{name}`. {summary}",
    "Implement a small Python class `{name}` that does this:\n{doc}\nShow how to use it.",
]


def signature(node: ast.FunctionDef) -> str:
    args = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
    if node.args.vararg:
        args.append("*" + node.args.vararg.arg)
    args += [a.arg for a in node.args.kwonlyargs]
    if node.args.kwarg:
        args.append("**" + node.args.kwarg.arg)
    return f"{node.name}({', '.join(args)})"


def clean(doc: str) -> tuple[str, str]:
    """The docstring's first paragraph (the summary) and its first three paragraphs."""
    paras = [" ".join(p.split()) for p in doc.strip().split("\n\n") if p.strip()]
    # Doctest examples and option tables make poor prompts: stop at the first.
    kept = []
    for p in paras[:3]:
        if ">>>" in p or p.startswith(("Usage", "Example")):
            break
        kept.append(p)
    return (kept[0] if kept else ""), "\n\n".join(kept)


def prompts_of(path: Path, rng: random.Random):
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        summary, body = clean(doc)
        if len(summary) < 40 or len(body) > 1500:
            continue
        if isinstance(node, ast.ClassDef):
            t = rng.choice(CLASS_TEMPLATES)
            yield t.format(name=node.name, summary=summary, doc=body)
        else:
            t = rng.choice(TEMPLATES)
            yield t.format(sig=signature(node), name=node.name, summary=summary, doc=body)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", type=Path, help="a source tree to read instead of the standard library")
    ap.add_argument("--skip-dir", action="append", default=[], metavar="NAME",
                    help="also leave out folders of this name (repeatable)")
    a = ap.parse_args()
    root = a.root or Path(sysconfig.get_paths()["stdlib"])
    rng = random.Random(a.seed)
    seen, out = set(), []
    skip = set(a.skip_dir)
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts[:-1]
        if SKIP_DIRS.intersection(parts) or skip.intersection(parts) or any(p.startswith("config-") for p in parts) or path.name.startswith("test_"):
            continue
        for p in prompts_of(path, rng):
            if p not in seen:
                seen.add(p)
                out.append(p)
    rng.shuffle(out)
    with open(a.out, "w", encoding="utf-8") as f:
        for p in out:
            f.write(json.dumps({"prompt": p}, ensure_ascii=False) + "\n")
    what = "the standard library" if a.root is None else "the source tree"
    print(f"{len(out)} prompts from {what} in {root} → {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
