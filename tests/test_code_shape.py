"""The shape of the code: no function longer than a screenful or so, outside the compiled kernels."""

from __future__ import annotations

import ast
from pathlib import Path

import attnflow

SOURCE = Path(attnflow.__file__).parent
LONGEST = 80  # lines, from `def` to the last line, docstring included
EXEMPT = {"methods/flow_kernels.py"}  # numba kernels: one loop nest each, split only at a cost in speed


def long_functions(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function or method in ``source`` longer than `LONGEST` lines."""
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > LONGEST
    ]


def test_the_oracle_counts_lines_from_def_to_the_end():
    body = "\n".join(f"    x{i} = {i}" for i in range(LONGEST - 2))
    exactly = f"def f():\n    '''doc'''\n{body}\n"
    one_more = f"class C:\n    def g(self):\n        '''doc'''\n{body.replace('    ', '        ')}\n        return 1\n"
    assert long_functions(exactly) == []
    assert long_functions(one_more) == [("g", 2, LONGEST + 1)]


def test_no_function_is_longer_than_80_lines():
    found = [
        f"{path.relative_to(SOURCE)}:{line} {name} ({length} lines)"
        for path in sorted(SOURCE.rglob("*.py"))
        if path.relative_to(SOURCE).as_posix() not in EXEMPT
        for name, line, length in long_functions(path.read_text(encoding="utf-8"))
    ]
    assert not found, f"functions over {LONGEST} lines (split them into named steps):\n" + "\n".join(found)
