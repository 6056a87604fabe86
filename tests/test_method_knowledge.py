"""A method owns its knowledge: no fedpeft module outside a registered method's package names that method by a
string literal equal to its name (docstrings aside). The exceptions below are not knowledge of the method named:
an option value that happens to equal an algorithm's name, and the config's defaults. The list may only
shrink, and a new literal outside its method's package fails here."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import fedpeft
from fedpeft.algorithms import ALGORITHMS
from fedpeft.tuners import PEFT_METHODS

SRC = Path(fedpeft.__file__).resolve().parent

# (module path under src/fedpeft, method name): literals equal to a method's name outside its package, and why
KNOWN = {
    # an option value, not the algorithm: FedPepTAO's server_optimizer / head_server_step and headprune's
    # aggregation choose "fedavg", a plain weighted mean, in their own server step (configs name them so)
    ("algorithms/fedpeptao/halves.py", "fedavg"), ("algorithms/fedpeptao/options.py", "fedavg"),
    ("algorithms/headprune/halves.py", "fedavg"), ("algorithms/headprune/options.py", "fedavg"),
    # the config's defaults (peft.method: lora, algorithm.name: fedavg: DEFAULT_CHOICES)
    ("config/schema.py", "lora"), ("config/schema.py", "fedavg"),
}


def built_in_owners() -> dict[str, str]:
    """Each built-in method's name -> the package that registered it, as a path under src/fedpeft."""
    owners = {}
    for registry in (ALGORITHMS, PEFT_METHODS):
        for name in registry.names():
            module = registry.origin(name)
            if module.startswith("fedpeft."):  # (plugins other tests loaded are registered too)
                owners[name] = module.removeprefix("fedpeft.").replace(".", "/")
    return owners


def docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def method_literals() -> set[tuple[str, str]]:
    """(module path, method name) for every literal equal to a built-in's name outside that method's package."""
    owners = built_in_owners()
    found = set()
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                owner = owners.get(node.value)
                if owner is not None and not (rel.startswith(owner + "/") or rel == owner + ".py"):
                    found.add((rel, node.value))
    return found


def test_no_new_method_name_literal_outside_its_method():
    new = sorted(method_literals() - KNOWN)
    assert not new, ("a method's name written outside its package (move the knowledge into the method, or "
                     f"declare it there): {new}")


def test_the_list_of_exceptions_only_shrinks():
    gone = sorted(KNOWN - method_literals())
    assert not gone, f"these literals are gone: remove them from KNOWN in this file: {gone}"


def test_the_check_finds_a_literal_outside_its_method(tmp_path, monkeypatch):
    stray = SRC / "report" / "_stray_literal_for_test.py"
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / stray.name).write_text('"""lora"""\nMETHOD = "houlsby"\n')  # a docstring is no literal
    (tmp_path / "tuners" / "bottleneck").mkdir(parents=True)
    (tmp_path / "tuners" / "bottleneck" / "ok.py").write_text('NAME = "houlsby"\n')
    assert method_literals() == {(f"report/{stray.name}", "houlsby")}
