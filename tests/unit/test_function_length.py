"""No product function is longer than MAX_LINES: each reads as one step, and a longer one is split
along the steps it already has (a comment heading a block names the function to extract)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 80
PRODUCT = ("plugins", "node", "train", "scripts", "bench")


def product_files():
    files = [ROOT / "conftest.py"]
    for folder in PRODUCT:
        files += sorted(p for p in (ROOT / folder).rglob("*.py")
                        if not {"tests", "fixtures", "__pycache__"} & set(p.relative_to(ROOT).parts))
    return files


def long_functions(path):
    """(name, first line, lines) of each function in path (nested ones and methods too) longer
    than MAX_LINES, from its def (decorators apart) to its last line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_LINES]


def test_the_product_files_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in product_files()}
    assert {"conftest.py", "train/run.py", "plugins/filter/preflight.py"} <= names


def test_no_function_is_longer_than_max_lines():
    long = [f"{path.relative_to(ROOT)}:{line} {name}: {lines} lines"
            for path in product_files() for name, line, lines in long_functions(path)]
    assert not long, (f"functions longer than {MAX_LINES} lines: " + "; ".join(long)
                      + ". Fix: split each along its steps into well-named functions.")
