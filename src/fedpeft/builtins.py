"""fedpeft's own algorithms, PEFT methods, datasets, trackers and runtimes, registered as any installed plugin is.

fedpeft's package metadata declares :func:`register` in the ``fedpeft.plugins`` entry-point group
(``pyproject.toml``), the door an installed plugin package uses; :mod:`fedpeft.plugins` calls it before
anything reads the registries. It imports every package below :data:`METHOD_PACKAGES`: each built-in method's
package registers itself when imported (``fedpeft/algorithms/<name>/__init__.py``,
``fedpeft/tuners/<name>/__init__.py``), so adding a built-in touches its own folder and nothing else. The
registering modules import no torch: they give their code as ``"module:attribute"`` references.
"""

from __future__ import annotations

import importlib
import pkgutil

METHOD_PACKAGES = ("fedpeft.algorithms", "fedpeft.tuners")
# the modules that register the built-in datasets, trackers and runtimes through the public functions
# (fedpeft.register_dataset, register_tracker, register_runtime); each is light (no torch, no Flower)
SEAM_MODULES = ("fedpeft.data.catalog", "fedpeft.tracking.backends", "fedpeft.launchers")


def register() -> None:
    """Register every built-in algorithm, PEFT method, dataset, tracker and runtime (importing a module twice
    does nothing)."""
    for module in SEAM_MODULES:
        importlib.import_module(module)
    for root in METHOD_PACKAGES:
        package = importlib.import_module(root)
        for found in pkgutil.walk_packages(package.__path__, prefix=f"{root}."):
            if found.ispkg:
                importlib.import_module(found.name)
