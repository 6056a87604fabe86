"""One method, one place: a built-in method is a package that owns its options, code and registration, and the
registries are the only lists of methods (the config, `fedpeft methods`, `fedpeft model` and the docs read them).

The contract tests at the end iterate over the registries, so every registered method (built-in or added
later) is held to them.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import fedpeft
import fedpeft.config
from fedpeft import builtins
from fedpeft.algorithms.base import ClientAlgorithm, ServerAlgorithm
from fedpeft.cli import main
from fedpeft.config import load_config
from fedpeft.config.schema import AlgorithmOptions, PeftOptions
from fedpeft.plugins import BUILT_INS_ENTRY_POINT
from fedpeft.registry import (
    ALGORITHMS,
    DATASETS,
    PEFT_METHODS,
    ROBUST_RULES,
    RUNTIMES,
    TRACKERS,
    CodeRef,
)

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "fedpeft"

ALGORITHM_PACKAGE = {
    "__init__.py": '''"""Throwaway: FedAvg under another name, to show that a built-in needs only its folder."""

from fedpeft.algorithms.registry import register_algorithm
from fedpeft.algorithms.throwaway.options import ThrowawayOptions



def register():
    register_algorithm("throwaway", options=ThrowawayOptions,
                       server="fedpeft.algorithms.throwaway.halves:ThrowawayServer",
                       client="fedpeft.algorithms.fedavg.halves:fedavg_client")
''',
    "options.py": '''from typing import Literal

from pydantic import Field

from fedpeft.config.schema import AlgorithmOptions


class ThrowawayOptions(AlgorithmOptions):
    """Throwaway: FedAvg under another name."""

    name: Literal["throwaway"] = "throwaway"
    server_lr: float = Field(1.0, gt=0)
    dp: None = None
''',
    "halves.py": '''from fedpeft.algorithms.fedavg.halves import FedAvgServer


class ThrowawayServer(FedAvgServer):
    pass
''',
}

PEFT_PACKAGE = {
    "__init__.py": '''"""Throwaway: only the biases train, under another name."""

import fedpeft
from fedpeft.tuners.throwaway_peft.options import ThrowawayPeftOptions



def register():
    fedpeft.register_peft_method("throwaway_peft", options=ThrowawayPeftOptions,
                                 apply="fedpeft.tuners.bitfit.apply:apply_bitfit")
''',
    "options.py": '''from typing import Literal

from fedpeft.config.schema import PeftOptions


class ThrowawayPeftOptions(PeftOptions):
    """Throwaway: only the biases train."""

    method: Literal["throwaway_peft"] = "throwaway_peft"
''',
}


def _write_package(root: Path, name: str, files: dict[str, str]) -> None:
    (root / name).mkdir(parents=True)
    for file, text in files.items():
        (root / name / file).write_text(text)


@pytest.fixture
def throwaway_built_ins(tmp_path, monkeypatch):
    """A new built-in algorithm and PEFT method, each in its own folder and nowhere else: the folders are
    added to the fedpeft.algorithms / fedpeft.tuners packages' search paths, as if they sat in src/."""
    import fedpeft.algorithms
    import fedpeft.tuners

    _write_package(tmp_path / "algorithms", "throwaway", ALGORITHM_PACKAGE)
    _write_package(tmp_path / "tuners", "throwaway_peft", PEFT_PACKAGE)
    monkeypatch.setattr(fedpeft.algorithms, "__path__", [*fedpeft.algorithms.__path__, str(tmp_path / "algorithms")])
    monkeypatch.setattr(fedpeft.tuners, "__path__", [*fedpeft.tuners.__path__, str(tmp_path / "tuners")])
    builtins.register()  # what fedpeft's entry point runs: it finds the new folders by itself
    yield
    ALGORITHMS.remove("throwaway")
    PEFT_METHODS.remove("throwaway_peft")
    for name in [m for m in sys.modules if ".throwaway" in m]:
        del sys.modules[name]


def test_a_new_built_in_needs_only_its_own_folder(throwaway_built_ins, capsys):
    # the config accepts both names, with their options
    cfg = load_config(None, ["algorithm={name: throwaway, server_lr: 0.5}", "peft.method=throwaway_peft"])
    assert type(cfg.algorithm).__name__ == "ThrowawayOptions" and cfg.algorithm.server_lr == 0.5
    assert cfg.peft.method == "throwaway_peft"
    assert ALGORITHMS["throwaway"].server.__name__ == "ThrowawayServer"  # its code, imported on first use
    # the CLI's listing
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  throwaway +Throwaway: FedAvg under another name\. +\[fedpeft\.algorithms\.throwaway\]$", out,
                     re.MULTILINE), out
    assert re.search(r"^  throwaway_peft +Throwaway: only the biases train\. +\[fedpeft\.tuners\.throwaway_peft\]$",
                     out, re.MULTILINE), out
    # fedpeft model counts the new PEFT method on a real architecture
    assert main(["model", "tiny-bert", "--methods", "bitfit,throwaway_peft", "--json"]) == 0
    import json

    rows = {row["method"]: row for row in json.loads(capsys.readouterr().out)["methods"]}
    assert rows["throwaway_peft"]["trainable"] == rows["bitfit"]["trainable"] > 0
    # the docs' method table and options reference, as the site's build fills them in
    hooks = _docs_hooks()
    page = (REPO / "docs" / "methods" / "index.md").read_text()
    filled = hooks.on_page_markdown(page)
    assert "| `throwaway` | Throwaway: FedAvg under another name. | `server_lr`, `dp`" in filled
    assert "| `throwaway_peft` | Throwaway: only the biases train. | none | `fedpeft.tuners.throwaway_peft` |" in filled
    options_page = hooks.on_page_markdown((REPO / "docs" / "api" / "options.md").read_text())
    assert "::: fedpeft.algorithms.throwaway.options.ThrowawayOptions" in options_page
    assert "::: fedpeft.tuners.throwaway_peft.options.ThrowawayPeftOptions" in options_page


def _docs_hooks():
    spec = importlib.util.spec_from_file_location("fedpeft_docs_hooks", REPO / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_list_every_registered_method():
    hooks = _docs_hooks()
    filled = hooks.on_page_markdown((REPO / "docs" / "methods" / "index.md").read_text())
    for name in [*ALGORITHMS, *PEFT_METHODS]:
        assert f"| `{name}` |" in filled
    assert "<!-- fedpeft:" not in filled


def test_no_static_list_of_built_in_options_remains():
    """The config's choices are the registries': the schema holds no table of method options and names no
    method's options class, and each built-in's options live in its own package."""
    schema = (SRC / "config" / "schema.py").read_text()
    for entry in [*ALGORITHMS.values(), *PEFT_METHODS.values()]:
        assert entry.options.__name__ not in schema
    assert not hasattr(fedpeft.config.schema, "PEFT_OPTIONS") and not hasattr(fedpeft.config.schema,
                                                                               "ALGORITHM_OPTIONS")


IMPORT_EVERYTHING = """
import importlib, json, pkgutil, sys
import fedpeft.config
light = sorted(m for m in sys.modules if m.startswith("fedpeft"))
from fedpeft.config.schema import RunConfig
fields = {name: repr(field.annotation) for name, field in RunConfig.model_fields.items()}
import fedpeft
missing = []
for found in pkgutil.walk_packages(fedpeft.__path__, prefix="fedpeft."):
    try:
        importlib.import_module(found.name)
    except ModuleNotFoundError as exc:  # an optional package (mlflow, wandb, ...)
        missing.append(exc.name)
from fedpeft import registry
sizes = {r.kind: len(r) for r in (registry.ALGORITHMS, registry.PEFT_METHODS, registry.ROBUST_RULES,
                                  registry.DATASETS, registry.TRACKERS, registry.RUNTIMES)}
same = fields == {name: repr(field.annotation) for name, field in RunConfig.model_fields.items()}
print(json.dumps({"light": light, "sizes": sizes, "same": same, "missing": missing,
                  "imported": sum(m.startswith("fedpeft.") for m in sys.modules)}))
"""


def test_importing_any_fedpeft_module_registers_nothing_and_changes_no_class():
    """Registration is an explicit step (fedpeft.plugins.load_built_ins, run by a run, a command, a config's
    validation): in a fresh interpreter, importing fedpeft.config loads only the layers at and below it (no
    method package, not builtins through the entry point), and importing every fedpeft module after it
    registers nothing and leaves the config's class as it was."""
    import json

    out = subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING], capture_output=True, text=True, check=True)
    found = json.loads(out.stdout)
    ladder = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    below = [m.strip() for layer in ladder[ladder.index("fedpeft.config"):] for m in layer.split("|")]
    assert found["light"] and all(m == "fedpeft" or m.startswith(tuple(below)) for m in found["light"]), found["light"]
    assert found["imported"] > 150  # every module was imported
    assert not [m for m in found["missing"] if m is None or m.startswith("fedpeft")]
    assert found["sizes"] == dict.fromkeys(found["sizes"], 0) and found["same"]


def test_the_ladder_holds_counting_imports_made_only_for_type_checkers(tmp_path):
    """The ladder's contract leaves out ``if TYPE_CHECKING:`` imports (they never run); counted, they still
    climb no layer, so no type-only import makes a loop (the registries name no entry type from above them).
    Only ``fedpeft/__init__.py``'s block is left out, which shows a type checker the lazy public names."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["id"] == "ladder")["layers"]
    config = tmp_path / "type-only.ini"
    config.write_text("\n".join([
        "[importlinter]", "root_package = fedpeft", "include_external_packages = True",
        "exclude_type_checking_imports = False", "[importlinter:contract:ladder-with-types]",
        "name = the ladder, type-only imports counted", "type = layers", "layers =",
        *(f"    {layer}" for layer in layers), "ignore_imports =", "    fedpeft.** -> fedpeft"]) + "\n")
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), str(config)], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert out.returncode == 0 and "1 kept, 0 broken" in out.stdout, out.stdout[-3000:]


PUBLIC_READS = """
from fedpeft.data.catalog import dataset_entry
import fedpeft.tuners, fedpeft.algorithms
from fedpeft.config.schema import RuntimeConfig
from fedpeft.registry import PEFT_METHODS
print(len(PEFT_METHODS), dataset_entry("sst2").hub_id, len(fedpeft.tuners.PEFT_METHODS),
      len(fedpeft.algorithms.ALGORITHMS), RuntimeConfig(name="flower").name)
"""


def test_the_public_reads_register_the_built_ins_first():
    """Nothing registers at import, so every public way of reading a registry registers fedpeft's built-ins first
    (a fresh interpreter: the test suite itself registers them in conftest.py)."""
    out = subprocess.run([sys.executable, "-c", PUBLIC_READS], capture_output=True, text=True, check=True)
    raw_before, hub_id, methods, algorithms, runtime = out.stdout.split()
    assert (raw_before, hub_id, runtime) == ("0", "nyu-mll/glue", "flower")
    assert int(methods) >= 9 and int(algorithms) >= 14


def test_the_registration_functions_the_origin_skips_are_fedpeft_s_own():
    from fedpeft import registry

    assert all(callable(getattr(fedpeft, name)) for name in registry._REGISTRATION_FUNCTIONS)
    assert registry._REGISTRATION_FUNCTIONS == {n for n in fedpeft.__all__ if n.startswith("register_")}


def test_registering_every_built_in_imports_no_torch():
    probe = ("import sys; from fedpeft.plugins import load_built_ins; load_built_ins(); "
             "from fedpeft.registry import ALGORITHMS, PEFT_METHODS; "
             "print(len(ALGORITHMS), len(PEFT_METHODS), 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    algorithms, methods, torch, transformers = out.stdout.split()
    def built_in(registry):  # this process may hold plugins' methods too
        return sum(e.options.__module__.startswith("fedpeft.") for e in registry.values())

    assert (int(algorithms), int(methods)) == (built_in(ALGORITHMS), built_in(PEFT_METHODS))
    assert built_in(ALGORITHMS) >= 14 and built_in(PEFT_METHODS) >= 9
    assert (torch, transformers) == ("False", "False")


def test_the_built_ins_come_through_the_entry_point_group():
    from importlib.metadata import entry_points

    from fedpeft.plugins import ENTRY_POINT_GROUP

    own = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.dist is not None and ep.dist.name == "fedpeft"]
    assert [ep.value for ep in own] == [BUILT_INS_ENTRY_POINT] == ["fedpeft.builtins:register"]
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][ENTRY_POINT_GROUP]
    assert declared == {"fedpeft": BUILT_INS_ENTRY_POINT}


def test_without_the_entry_point_in_the_metadata_the_built_ins_still_register_with_a_warning():
    """An install older than the source (its metadata lacks the entry point) or a bare source tree: the same
    entry point is called, and the log says to reinstall."""
    probe = ("import logging, importlib.metadata as md; logging.basicConfig(level=logging.WARNING); "
             "real = md.entry_points; "
             "md.entry_points = lambda group: [e for e in real(group=group) if e.dist is None or e.dist.name != 'fedpeft']; "
             "import fedpeft.plugins as P; P.entry_points = md.entry_points; "
             "P.load_built_ins(); from fedpeft.registry import ALGORITHMS; print(len(ALGORITHMS))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert int(out.stdout) >= 14
    assert "lacks its fedpeft.plugins entry point" in out.stderr and "reinstall" in out.stderr


def test_a_failing_built_in_registration_is_retried_rather_than_forgotten(monkeypatch):
    from fedpeft import plugins

    calls = []

    def failing(entry_point):
        calls.append(entry_point.value)
        raise plugins.PluginError("boom")

    monkeypatch.setattr(plugins, "_built_ins_loaded", False)
    monkeypatch.setattr(plugins, "_call", failing)
    for _ in range(2):
        with pytest.raises(plugins.PluginError, match="boom"):
            plugins.load_built_ins()
    assert calls == [BUILT_INS_ENTRY_POINT] * 2 and plugins._built_ins_loaded is False


def test_the_architecture_page_shows_the_ladder_the_contracts_enforce():
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["id"] == "ladder")["layers"]
    expected = [sorted(m.strip().removeprefix("fedpeft.") for m in layer.split("|")) for layer in layers]
    page = (REPO / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", page[page.index("## The import ladder"):], re.MULTILINE)
    shown = [sorted(m.strip(" `") for m in cells.split(",")) for _, cells in rows]
    assert shown == expected


def test_every_top_level_module_is_on_the_ladder():
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["id"] == "ladder")["layers"]
    placed = {m.strip().removeprefix("fedpeft.") for layer in layers for m in layer.split("|")}
    present = {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    assert present == placed


# --- contract tests over the registries ---------------------------------------------------------------


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithm_registers_options_and_halves_that_fit(name):
    entry = ALGORITHMS[name]
    assert issubclass(entry.options, AlgorithmOptions) and entry.options().name == name
    assert isinstance(entry.server, type) and issubclass(entry.server, ServerAlgorithm)
    client = entry.client(entry.options())
    assert isinstance(client, ClientAlgorithm)


@pytest.mark.parametrize("name", PEFT_METHODS.names())
def test_every_peft_method_registers_options_and_code_that_fit(name):
    entry = PEFT_METHODS[name]
    assert issubclass(entry.options, PeftOptions) and entry.options().method == name
    assert callable(entry.apply)
    assert (entry.head_params is not None) == entry.options.maps_to_heads


@pytest.mark.parametrize("entry", [*ALGORITHMS.values(), *PEFT_METHODS.values()], ids=lambda e: e.name)
def test_every_built_in_lives_in_its_own_package(entry):
    """A built-in's options sit in its package's options.py, and that package's __init__ registers it."""
    module = entry.options.__module__
    if not module.startswith("fedpeft."):
        pytest.skip("a plugin's method")
    package = module.removesuffix(".options")
    assert module.endswith(".options") and package.count(".") >= 2
    code = entry.server_code if hasattr(entry, "server_code") else entry.apply_code
    assert isinstance(code, CodeRef) and code.path.startswith(("fedpeft.algorithms.", "fedpeft.tuners."))
    init = (SRC.parent / Path(*package.split(".")) / "__init__.py").read_text()
    assert f'"{entry.name}"' in init


def test_a_code_reference_is_checked_when_registered():
    from typing import Literal

    class BadRef(fedpeft.PeftOptions):
        method: Literal["badref"] = "badref"

    with pytest.raises(ValueError, match="write it as 'package.module:attribute'"):
        fedpeft.register_peft_method("badref", options=BadRef, apply="no_colon_here")
    assert "badref" not in PEFT_METHODS


def test_a_taken_name_is_refused_naming_who_registered_it(tmp_path):
    from fedpeft.plugins import PluginError, load_plugin

    text = "import fedpeft\nfedpeft.register_dataset('twice_registered', task='classification', hub_id='org/{}')\n"
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text(text.format("a"))
    second.write_text(text.format("b"))
    try:
        load_plugin(str(first))
        with pytest.raises(PluginError, match=rf"task.dataset 'twice_registered' is already registered \(by "
                                             rf"{re.escape(str(first))}\); choose another name"):
            load_plugin(str(second))
    finally:
        DATASETS.remove("twice_registered")


def _code_refs(value):
    """The CodeRefs in an entry's field (row_forwards holds pairs of them)."""
    if isinstance(value, CodeRef):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _code_refs(item)


@pytest.mark.parametrize("registry", [TRACKERS, RUNTIMES, DATASETS, ALGORITHMS, PEFT_METHODS, ROBUST_RULES],
                         ids=lambda r: r.kind)
def test_every_built_in_code_reference_resolves(registry):
    """A typo in a built-in's "module:attribute" (mypy cannot see into the strings) would otherwise surface only
    when that entry is first used: every reference of every registered entry resolves to a class or function."""
    checked = 0
    for name, entry in registry.items():
        for field in vars(entry).values():
            for ref in _code_refs(field):
                assert callable(ref.load()), f"{registry.kind} {name}: {ref.path}"
                checked += 1
    assert checked >= {"dataset": 0, "algorithm": 2 * 14, "PEFT method": 2 * 9, "robust rule": 5}.get(registry.kind, 1)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_wrapper_reference_resolves():
    """The wrappers' options name their code as "module:attribute" (the config layer imports none of it): every
    one of every wrapper kind the registered algorithms offer resolves to a wrapper of the right half."""
    from fedpeft.algorithms.wrapping import ClientWrapper, ServerWrapper
    from fedpeft.config.wrapping import WrapperOptions

    kinds = {sub for sub in _subclasses(WrapperOptions)}
    assert {k.key for k in kinds} >= {"algorithm.robust", "algorithm.dp"}
    for kind in kinds:
        assert issubclass(CodeRef(kind.server_wrapper).load(), ServerWrapper), kind
        if kind.client_wrapper is not None:
            assert issubclass(CodeRef(kind.client_wrapper).load(), ClientWrapper), kind


# FedProx is FedAvg with a proximal term: its halves build on FedAvg's
ALLOWED_BETWEEN_METHODS = {("fedpeft.algorithms.fedprox", "fedpeft.algorithms.fedavg")}


def test_no_built_in_method_package_reaches_into_another():
    """Over every registered built-in (so a new one is covered without a list to edit): the package of one
    method imports nothing of another's, directly or through a chain."""
    import grimp

    graph = grimp.build_graph("fedpeft", exclude_type_checking_imports=True)
    packages = sorted({e.options.__module__.removesuffix(".options") for e in [*ALGORITHMS.values(),
                                                                                *PEFT_METHODS.values()]
                       if e.options.__module__.startswith("fedpeft.") and e.options.__module__.endswith(".options")})
    assert len(packages) >= 14
    reaching = [(a, b) for a in packages for b in packages
                if a != b and (a, b) not in ALLOWED_BETWEEN_METHODS and graph.chain_exists(a, b, as_packages=True)]
    assert reaching == []
