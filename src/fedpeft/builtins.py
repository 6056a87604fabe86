"""fedpeft's own algorithms, PEFT methods, datasets, trackers and runtimes, registered as any installed plugin is.

fedpeft's package metadata declares :func:`register` in the ``fedpeft.plugins`` entry-point group
(``pyproject.toml``), the door an installed plugin package uses; :func:`fedpeft.plugins.load_built_ins` calls it
when a run, a command or a config's validation first needs the registries. Importing a fedpeft module registers
nothing: each built-in method's package has a ``register()`` (``fedpeft/algorithms/<name>/__init__.py``,
``fedpeft/tuners/<name>/__init__.py``; the robust rules' ``fedpeft/algorithms/robust/__init__.py``) that registers
it through the public functions a plugin calls (a package without one, such as ``lora/`` or ``privacy/``, shares
code and registers nothing), and
:func:`register` finds those packages below :data:`METHOD_PACKAGES` by itself, so adding a built-in touches its own
folder and nothing else. The registering modules import no torch: they give their code as ``"module:attribute"``
references.
"""

from __future__ import annotations

import importlib
import pkgutil

METHOD_PACKAGES = ("fedpeft.algorithms", "fedpeft.tuners")


def register() -> None:
    """Register every built-in dataset, tracker, runtime, algorithm and PEFT method (again: an equal entry
    registered twice is kept once)."""
    from fedpeft.data.catalog import register_built_in_datasets
    from fedpeft.launchers import register_built_in_runtimes
    from fedpeft.tracking.backends import register_built_in_trackers

    register_built_in_datasets()
    register_built_in_trackers()
    register_built_in_runtimes()
    for root in METHOD_PACKAGES:
        package = importlib.import_module(root)
        for found in pkgutil.walk_packages(package.__path__, prefix=f"{root}."):
            if not found.ispkg:
                continue
            register_package = getattr(importlib.import_module(found.name), "register", None)
            if callable(register_package):  # a method's package (a family's shared package, lora/, has none)
                register_package()
