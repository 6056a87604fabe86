"""The documentation's samples: every ```python block of README.md and docs/ is named and run by a test (the
two Python API samples run here), every `fedpeft ...` line of a ```bash block is a command the CLI accepts,
with configs and example files that exist and `--set` keys a config takes; the README is a front door whose
links resolve, and its test command is the one CI runs."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
from conftest import REPO
from docs_samples import MARKER, Sample, all_blocks, doc_pages, docs_sample, named_python_samples

import fedpeft
from fedpeft.cli import build_parser
from fedpeft.config import load_config

# A run of the Python API samples in seconds: the tiny random BERT on a few SST-2 rows (the settings of
# tests/helpers.py's tiny_config, but the rounds, which the samples set).
TINY = ["model.name=tiny-bert", "task.max_train_examples=64", "task.max_length=32", "federation.num_clients=4",
        "federation.clients_per_round=2", "train.batch_size=8", "eval.max_examples=32", "eval.batch_size=32",
        "runtime.progress=false"]


# -- every ```python block is named and run by a test ------------------------------------------------------

def test_every_python_sample_is_named_and_run_by_the_test_it_names():
    blocks = all_blocks("python")
    assert len(blocks) >= 4  # the loading samples and the Python API samples, at least
    for block in blocks:
        found = MARKER.fullmatch(block.marker or "")
        assert found, (f"{block.where}: a ```python block without a name: put "
                       "<!-- sample NAME: run by tests/test_x.py --> on the line above it and run "
                       "docs_sample('NAME') in that test")
        compile(block.code, block.where, "exec")
        test_file = REPO / found.group("test")
        assert test_file.is_file(), f"{block.where}: {found.group('test')} does not exist"
        call = re.compile(r"docs_sample\(\s*['\"]" + re.escape(found.group("name")) + r"['\"]\s*\)")
        assert call.search(test_file.read_text()), (
            f"{block.where}: {found.group('test')} never runs docs_sample({found.group('name')!r})")
    names = [MARKER.fullmatch(b.marker).group("name") for b in blocks]
    assert len(names) == len(set(names)), f"two ```python blocks share a name: {sorted(names)}"
    assert set(named_python_samples()) == set(names)


@pytest.mark.needs_data
def test_the_python_api_samples_run_as_written(monkeypatch, capsys):
    """docs/guide/python-api.md's two samples, one after the other in one namespace (the second uses the first's
    cfg), with the quickstart config made tiny (load_config adds TINY's settings before the sample's own)."""
    Path("configs").mkdir()
    shutil.copy(REPO / "configs" / "quickstart.yaml", "configs/quickstart.yaml")
    real_load, real_run = fedpeft.load_config, fedpeft.run
    observers_seen: list = []

    def tiny_load(path, overrides=(), plugins=()):
        return real_load(path, [*TINY, *overrides], plugins)

    def run_and_keep_observers(config, run_dir=None, **kwargs):
        observers_seen.extend(kwargs.get("observers", ()))
        return real_run(config, run_dir, **kwargs)

    monkeypatch.setattr(fedpeft, "load_config", tiny_load)
    monkeypatch.setattr(fedpeft, "run", run_and_keep_observers)
    namespace: dict = {}
    exec(compile(docs_sample("python-api"), "docs python-api sample", "exec"), namespace)  # noqa: S102
    assert namespace["cfg"].seed == 1 and namespace["cfg"].federation.rounds == 10
    assert namespace["summary"]["rounds"] == 15  # resumed and extended from 10 rounds to 15
    assert [r["round"] for r in namespace["rows"]] == list(range(16))
    assert namespace["model"] is not None
    exec(compile(docs_sample("run-observer"), "docs run-observer sample", "exec"), namespace)  # noqa: S102
    (observer,) = observers_seen[-1:]
    assert isinstance(observer, fedpeft.RunObserver) and len(observer.sent) == 2  # 2 clients per round
    assert all(size > 0 for size in observer.sent.values())
    assert fedpeft.read_summary("runs/watched")["rounds"] == 10


# -- every `fedpeft ...` line of a ```bash block is a command the CLI takes --------------------------------

def shell_commands(block: Sample) -> list[list[str]]:
    """The commands of a ```bash block: continuation lines joined, comments dropped, `&&` chains split."""
    text = block.code.replace("\\\n", " ")
    commands = []
    for line in text.split("\n"):
        words = shlex.split(line, comments=True)
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", "&", ";", "|"):
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(word)
    return commands


def fedpeft_commands() -> list[tuple[Sample, list[str]]]:
    out = []
    for block in all_blocks("bash"):
        for command in shell_commands(block):
            if Path(command[0]).name == "fedpeft":
                out.append((block, command[1:]))
    return out


def test_the_docs_show_fedpeft_commands():
    subcommands = {argv[0] for _, argv in fedpeft_commands()}
    assert {"run", "eval", "report", "partition", "data", "model", "config", "flower"} <= subcommands


@pytest.mark.parametrize("block,argv", fedpeft_commands(), ids=lambda x: x.where if isinstance(x, Sample) else None)
def test_each_fedpeft_command_in_the_docs_parses_and_names_files_that_exist(block, argv):
    shown = "fedpeft " + shlex.join(argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{block.where}: the CLI refuses `{shown}`")
    for word in argv:
        for path in re.findall(r"(?:configs|examples)/[\w./-]+", word):
            assert (REPO / path).exists(), f"{block.where}: `{shown}` names {path}, which does not exist"
    config = getattr(args, "config", None) or getattr(args, "source", None)
    if args.command in ("run", "config", "partition") and config and not getattr(args, "plugin", None):
        # the settings it shows are ones a config takes (validation reads no data and loads no model)
        load_config(REPO / config, args.set)


def test_a_wrong_command_in_a_sample_would_be_caught():
    block = Sample(Path("x.md"), 1, "bash", "fedpeft run configs/quickstart.yaml --sett a=1\n", None)
    ((argv),) = [c[1:] for c in shell_commands(block)]
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    with pytest.raises(fedpeft.UserError):
        load_config(REPO / "configs/quickstart.yaml", ["train.optimiser=adamw"])


# -- the README is the front door ---------------------------------------------------------------------------

def test_readme_is_short_and_its_links_resolve():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links to the docs pages"
    for target in local:
        assert (REPO / target).exists(), f"README.md links to {target}, which does not exist"
    assert "pip install -e '.[docs]'" in readme and "mkdocs serve" in readme


def test_every_docs_page_is_in_the_site_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    for page in sorted((REPO / "docs").rglob("*.md")):
        assert str(page.relative_to(REPO / "docs")) in nav, f"{page} is in no mkdocs.yml nav entry"


def test_the_docs_site_loads_nothing_from_another_site():
    """The site works offline: mkdocs.yml names no remote script or style and no web font, and the build's hook
    (docs/hooks.py) turns the equations of every docs page into MathML that browsers draw without a script."""
    import importlib.util

    site = (REPO / "mkdocs.yml").read_text()
    assert "font: false" in site
    assert not re.search(r"^\s*-\s*https?://", site, re.MULTILINE), "mkdocs.yml loads an asset from another site"
    assert "extra_javascript" not in site and "extra_css" not in site
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = ('<p>a <span class="arithmatex">\\(\\eta &lt; 1\\)</span> and</p>'
            '<div class="arithmatex">\\[\\theta_{t+1} = \\theta_t - \\eta g_t\\]</div>')
    out = hooks.as_mathml(page)
    assert "arithmatex" not in out and out.count("<math") == 2 and 'display="block"' in out
    assert "<mi>&#x003B7;</mi><mo>&#x0003C;</mo><mn>1</mn>" in out  # (the escaped < read as <)
    equations = 0
    for md in sorted((REPO / "docs").rglob("*.md")):  # (every equation of the docs converts, none in part as text)
        for match in re.finditer(r"\\\((.+?)\\\)|\\\[(.+?)\\\]", md.read_text(), re.DOTALL):
            hooks.as_mathml(f'<div class="arithmatex">\\[{match.group(1) or match.group(2)}\\]</div>', str(md))
            equations += 1
    assert equations > 50
    with pytest.raises(ValueError, match="latex2mathml cannot read"):
        hooks.as_mathml('<span class="arithmatex">\\(\\left( x\\)</span>', "docs/x.md")
    for unknown in ("\\begin{aligned} a &= b \\end{aligned}", "\\notacommand x"):
        with pytest.raises(ValueError, match="does not know"):
            hooks.as_mathml(f'<div class="arithmatex">\\[{unknown}\\]</div>', "docs/x.md")


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci.startswith("bash scripts/install.sh test && ") and "mkdocs build --strict" in ci
    for page in ("README.md", "docs/getting-started.md"):
        assert ci in (REPO / page).read_text().splitlines(), f"{page} shows another test command than .ci/run"


# -- the files the docs name exist ---------------------------------------------------------------------------

REPO_PATH = re.compile(r"(?:\./)?((?:src|configs|examples|benchmarks|tests|scripts)/[\w./*-]+?)[,;:)]?")


def test_every_repository_path_the_docs_name_exists():
    """A code span naming a file of the repository (src/..., configs/..., examples/..., benchmarks/..., tests/...,
    scripts/...; globs allowed) names one that exists, so a moved module or config fails here until the page
    that names it moves with it."""
    for page in doc_pages():
        for span in re.findall(r"`([^`\n]+)`", page.read_text()):
            for word in span.split():
                found = REPO_PATH.fullmatch(word)
                if found and not list(REPO.glob(found.group(1).rstrip("/"))):
                    pytest.fail(f"{page.relative_to(REPO)} names {found.group(1)}, which does not exist")


def test_the_architecture_tables_name_modules_and_tests_that_exist():
    """The module map and the papers' map of docs/architecture.md: every file or folder in a table row exists
    (paths there are relative to src/fedpeft/, tests to tests/)."""
    rows = [line for line in (REPO / "docs" / "architecture.md").read_text().splitlines() if line.startswith("|")]
    named = {span for row in rows for span in re.findall(r"`([^`\n]+)`", row)
             if re.fullmatch(r"[\w/.*-]+(\.py|\.json|/)", span)}
    assert len(named) > 40
    for name in sorted(named):
        places = [REPO / "src" / "fedpeft", REPO / "tests", REPO]
        assert any(list(place.glob(name.rstrip("/"))) for place in places), (
            f"docs/architecture.md names {name}, which is neither in src/fedpeft/ nor in tests/")
