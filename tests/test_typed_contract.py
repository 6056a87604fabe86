"""The plugin contract carries real types: the annotations of what a plugin subclasses, fills in or calls resolve
to fedpeft's (and torch's, transformers') classes rather than ``Any``, ``fedpeft``'s lazy exports are visible to a
type checker, and mypy, given a plugin, accepts a correct one and reports the mistakes of a wrong one."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
import typing
from collections.abc import Callable
from pathlib import Path

import pytest

import fedpeft
from fedpeft.algorithms import base
from fedpeft.algorithms import registry as algorithm_registry
from fedpeft.registry import CodeRef, Registry
from fedpeft.tuners import registry as peft_registry

SRC = Path(fedpeft.__file__).resolve().parents[1]
EXAMPLES = SRC.parent / "examples"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _type_checking_imports(module_name: str) -> list[ast.stmt]:
    """The statements of ``module_name``'s ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(Path(importlib.import_module(module_name).__file__).read_text())
    return [stmt for node in tree.body if isinstance(node, ast.If) and _is_type_checking(node.test)
            for stmt in node.body]


def hints(obj: object, module_name: str) -> dict[str, typing.Any]:
    """``typing.get_type_hints(obj)``, with the names the module imports only for type checkers made available
    (running its ``if TYPE_CHECKING:`` imports also checks that they import)."""
    namespace: dict[str, typing.Any] = {}
    module = ast.Module(body=_type_checking_imports(module_name), type_ignores=[])
    exec(compile(module, module_name, "exec"), namespace)  # noqa: S102 (fedpeft's own import statements)
    module_globals = vars(importlib.import_module(module_name))
    # (a TypedDict's annotations are evaluated in their module's globals: the names go in as locals too)
    return typing.get_type_hints(obj, globalns={**module_globals, **namespace}, localns=namespace)


def test_the_lazy_exports_are_what_a_type_checker_sees():
    """Every name of ``fedpeft._EXPORTS`` is imported under ``if TYPE_CHECKING:`` from the module it is loaded
    from at run time (else ``fedpeft.ServerAlgorithm`` is ``Any`` to a type checker and a plugin is unchecked),
    and ``__all__`` lists exactly them."""
    seen = {}
    for stmt in _type_checking_imports("fedpeft"):
        assert isinstance(stmt, ast.ImportFrom), ast.unparse(stmt)
        for alias in stmt.names:
            seen[alias.asname or alias.name] = stmt.module
    assert seen == fedpeft._EXPORTS
    assert fedpeft.__all__ == sorted(fedpeft._EXPORTS)
    assert (SRC / "fedpeft" / "py.typed").is_file()  # PEP 561: an installed fedpeft is typed for plugin packages


def test_the_client_context_is_typed():
    from torch import Tensor

    from fedpeft.data.batching import Encoded, ImageEncoded
    from fedpeft.heads.layout import HeadLayout
    from fedpeft.training.local import TrainResult
    from fedpeft.tuners.prefix_layers import PrefixLayout
    from fedpeft.tuners.tuned import TunedModel

    fields = hints(base.ClientContext, "fedpeft.algorithms.base")
    assert fields["tuned"] is TunedModel
    assert fields["data"] == Encoded | ImageEncoded | None
    assert fields["train"] is base.LocalTrain
    assert fields["resources"] is base.ClientResources
    assert fields["evaluate_personal"] == Callable[[], dict[str, typing.Any] | None]
    train = hints(base.LocalTrain.__call__, "fedpeft.algorithms.base")
    assert train["return"] is TrainResult
    assert train["tuned"] == TunedModel | None
    assert train["extra_loss"] == Callable[[], Tensor] | None
    resources = hints(base.ClientResources, "fedpeft.algorithms.base")
    assert resources["layout"] == object | None  # what the algorithm's RuntimeNeeds.layout built (open)
    assert resources["pad_id"] == int | None  # (images pad nothing)
    assert typing.Any not in fields.values() and typing.Any not in resources.values()
    needs = hints(base.RuntimeNeeds, "fedpeft.algorithms.base")
    assert needs["layout"] == base.LayoutBuilder | str | None
    builder = hints(base.LayoutBuilder.__call__, "fedpeft.algorithms.base")
    assert builder["tuned"] is TunedModel and builder["return"] is object
    # fedpeft's own builders fit the protocol: (tuned, model_config) -> their layout
    from fedpeft.heads.layout import head_layout
    from fedpeft.tuners.prefix_layers import prefix_layout

    assert typing.get_type_hints(head_layout)["return"] is HeadLayout
    assert typing.get_type_hints(prefix_layout)["return"] is PrefixLayout
    assert list(inspect.signature(prefix_layout).parameters) == list(inspect.signature(head_layout).parameters)


def test_the_experiment_is_typed():
    """What a runtime builds from a config is typed: no field is Any but the partition's statistics (a JSON
    record), and the client resources are the contract's TypedDict."""
    from fedpeft.runtime import setup

    fields = hints(setup.Experiment, "fedpeft.runtime.setup")
    assert [name for name, kind in fields.items() if kind is typing.Any] == []
    assert fields["layout"] == object | None and fields["partition_stats"] == dict[str, typing.Any]
    assert typing.get_type_hints(setup.Experiment.client_resources.func)["return"] is base.ClientResources


def test_the_server_half_is_generic_over_its_options():
    from fedpeft.config.schema import AlgorithmOptions
    from fedpeft.training.server import ServerModel

    assert base.OptionsT.__bound__.__forward_arg__ == "AlgorithmOptions"
    init = hints(base.ServerAlgorithm.__init__, "fedpeft.algorithms.base")
    assert init["options"] is base.OptionsT
    assert init["layout"] == object | None
    assert init["server_model"] == ServerModel | None
    assert hints(base.ServerAlgorithm.runtime_needs, "fedpeft.algorithms.base")["options"] is base.OptionsT
    assert typing.Any not in init.values()
    # a built-in parametrizes it with its options model
    from fedpeft.algorithms.headprune.halves import HeadPruneServer
    from fedpeft.algorithms.headprune.options import HeadPruneOptions

    assert base.ServerAlgorithm[HeadPruneOptions] in HeadPruneServer.__orig_bases__
    assert issubclass(HeadPruneOptions, AlgorithmOptions)


def test_the_registration_functions_are_typed():
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from fedpeft.models.layout import ArchSpec

    algorithm = hints(algorithm_registry.register_algorithm, "fedpeft.algorithms.registry")
    assert algorithm["options"] == type[base.OptionsT]
    assert algorithm["server"] == type[base.ServerAlgorithm[base.OptionsT]] | CodeRef | str
    assert algorithm["client"] == Callable[[base.OptionsT], base.ClientAlgorithm] | CodeRef | str
    peft = hints(peft_registry.register_peft_method, "fedpeft.tuners.registry")
    options_t = peft_registry.PeftOptionsT
    assert peft["options"] == type[options_t]
    assert peft["apply"] == (Callable[[nn.Module, options_t, peft_registry.TunerContext], nn.Module]
                             | CodeRef | str)
    context = hints(peft_registry.TunerContext, "fedpeft.tuners.registry")
    assert context["tokenizer"] == PreTrainedTokenizerBase | None
    assert context["spec"] == ArchSpec | None
    entry = Registry.__parameters__[0]
    assert hints(Registry.add, "fedpeft.registry")["entry"] is entry
    assert hints(Registry.get, "fedpeft.registry")["return"] is entry
    for obj, module in ((algorithm_registry.register_algorithm, "fedpeft.algorithms.registry"),
                        (algorithm_registry.make_server, "fedpeft.algorithms.registry"),
                        (peft_registry.register_peft_method, "fedpeft.tuners.registry"),
                        (peft_registry.TunerContext, "fedpeft.tuners.registry"),
                        (base.RuntimeNeeds, "fedpeft.algorithms.base"), (CodeRef, "fedpeft.registry"),
                        (fedpeft.Payload, "fedpeft.wire"), (fedpeft.RunObserver.on_configure, "fedpeft.observer")):
        assert typing.Any not in hints(obj, module).values(), obj


def test_importing_the_contract_loads_no_torch():
    """The contract's types from the layers above are imported for type checkers only."""
    probe = ("import sys; import fedpeft.algorithms.base, fedpeft.algorithms.registry, fedpeft.tuners.registry, "
             "fedpeft.observer, fedpeft.wire, fedpeft.registry, fedpeft.plugins; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'flwr'}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- mypy, given a plugin -------------------------------------------------------------------------------------

mypy_api = pytest.importorskip("mypy.api", reason="mypy is in the test extra")

# torch, transformers and Flower are read as Any here (their stubs take most of a cold mypy run): these checks
# are about fedpeft's own types; `mypy` on the repository (CI) reads them in full.
MYPY_CONFIG = """\
[mypy]
python_version = 3.11
strict = True
follow_imports = silent
plugins = pydantic.mypy
mypy_path = {src}
cache_dir = {cache}

[mypy-torch.*,transformers.*,flwr.*,peft.*,datasets.*,pandas.*,matplotlib.*,safetensors.*,sklearn.*,scipy.*]
follow_imports = skip
ignore_missing_imports = True
"""


@pytest.fixture(scope="module")
def mypy(tmp_path_factory):
    root = tmp_path_factory.mktemp("mypy")
    config = root / "mypy.ini"
    config.write_text(MYPY_CONFIG.format(src=SRC, cache=root / "cache"))

    def check(*files: Path) -> tuple[str, int]:
        out, err, status = mypy_api.run(["--config-file", str(config), *map(str, files)])
        return out + err, status

    return check


def test_mypy_accepts_the_example_plugins(mypy, tmp_path):
    """The plugins in examples/ (written as a user writes one) type-check strictly against fedpeft."""
    files = []
    for plugin in sorted(EXAMPLES.glob("*/plugin.py")):
        copy = tmp_path / f"{plugin.parent.name}.py"  # one module name each, for one mypy run
        copy.write_text(plugin.read_text())
        files.append(copy)
    assert len(files) >= 3
    out, status = mypy(*files)
    assert status == 0, out


WRONG_PLUGIN = '''\
from __future__ import annotations

from typing import Literal

import fedpeft


class MyOptions(fedpeft.AlgorithmOptions):
    name: Literal["mine"] = "mine"
    server_lr: float = 1.0


class OtherOptions(fedpeft.AlgorithmOptions):
    name: Literal["other"] = "other"


class MyServer(fedpeft.ServerAlgorithm[MyOptions]):
    def aggregate(self, rnd: int, updates: dict[int, fedpeft.Payload]) -> dict[str, float]:
        step: float = self.options.server_lr  # fine: the options are a MyOptions
        layers = self.options.num_layers  # E: attr-defined
        self.server_model.tune(self.global_state, 1, rnd)  # E: union-attr
        return {"step": step, "layers": layers}


class ListServer(fedpeft.ServerAlgorithm[MyOptions]):
    def aggregate(self, rnd: int, updates: dict[int, fedpeft.Payload]) -> list[float]:  # E: override
        return []


class OtherServer(fedpeft.ServerAlgorithm[OtherOptions]):
    def aggregate(self, rnd: int, updates: dict[int, fedpeft.Payload]) -> dict[str, float]:
        return {}


class MyClient(fedpeft.ClientAlgorithm):
    def __init__(self, options: MyOptions) -> None:
        self.options = options

    def fit(self, payload: fedpeft.Payload, ctx: fedpeft.ClientContext) -> fedpeft.Payload:
        ctx.tuned.load_state(payload.arrays)
        ctx.tuned.load_weights(payload.arrays)  # E: attr-defined
        result = ctx.train(lr="fast")  # E: arg-type
        ctx.train(learning_rate=0.1)  # E: call-arg
        examples = len(ctx.data.input_ids)  # E: union-attr
        pad: str = ctx.resources["pad_id"]  # E: assignment
        return fedpeft.Payload(ctx.tuned.state(), {"round": 1, "loss": result.loss, "n": examples, "pad": pad})


fedpeft.register_algorithm("mine", options=MyOptions, server=MyServer, client=MyClient)
fedpeft.register_algorithm("mine", options=MyOptions, server=OtherServer, client=MyClient)  # E: misc
fedpeft.register_algorithm("mine", options=OtherOptions, server=OtherServer, client=MyClient)  # E: arg-type


class MyPeftOptions(fedpeft.PeftOptions):
    method: Literal["mine"] = "mine"
    scale: float = 1.0


def apply_mine(model: object, options: MyPeftOptions, ctx: fedpeft.TunerContext) -> object:
    ctx.tokenizer.pad_token_id  # E: union-attr
    return model


def apply_unscaled(model: object, options: MyOptions, ctx: fedpeft.TunerContext) -> object:
    return model


fedpeft.register_peft_method("mine", options=MyPeftOptions, apply=apply_mine)
fedpeft.register_peft_method("mine", options=MyPeftOptions, apply=apply_unscaled)  # E: arg-type
fedpeft.register_peft_method("mine", options=MyPeftOptions, apply=apply_mine, save_format="pickle")  # E: arg-type
'''


def test_mypy_reports_a_wrong_plugin(mypy, tmp_path):
    """Each line marked ``# E: code`` is reported with that error code, and nothing else is: the contract's
    types (generic options, ClientContext, the registration functions, TunerContext) are real to mypy."""
    plugin = tmp_path / "wrong_plugin.py"
    plugin.write_text(WRONG_PLUGIN)
    expected = {(n, line.split("# E: ")[1].strip()) for n, line in enumerate(WRONG_PLUGIN.splitlines(), 1)
                if "# E: " in line}
    out, status = mypy(plugin)
    reported = set()
    for line in out.splitlines():
        parts = line.split(":", 3)
        if len(parts) == 4 and parts[2].strip() == "error" and line.endswith("]"):
            reported.add((int(parts[1]), line.rsplit("[", 1)[1].rstrip("]")))
    assert status == 1, out
    assert reported == expected, out
