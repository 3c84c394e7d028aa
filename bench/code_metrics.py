"""Code-shape figures for the architecture issue's closing note: the largest modules, the longest
functions, and reads of another object's private attributes (`x._name` where x is not self/cls).

    python bench/code_metrics.py kvdata daemon
"""
import ast
import pathlib
import sys

roots = [pathlib.Path(p) for p in sys.argv[1:]]
files = [f for r in roots for f in r.rglob("*.py")]
longest = []
priv = []
for f in files:
    src = f.read_text()
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            longest.append((node.end_lineno - node.lineno + 1, f"{f}:{node.name}"))
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            v = node.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            priv.append(f"{f}:{node.lineno}:{ast.unparse(node)}")
mods = sorted(((len(f.read_text().splitlines()), str(f)) for f in files), reverse=True)
print("largest modules", mods[:3])
print("longest functions", sorted(longest, reverse=True)[:3])
print("private non-self reads", len(priv))
for p in priv:
    print("  ", p)
