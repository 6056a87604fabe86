"""Whether a Hugging Face Hub download may go ahead, decided in milliseconds.

``from_pretrained`` and ``datasets.load_dataset`` retry an unreachable Hub for 25-50 s before they give
up. Before calling them, fedpeft asks :func:`hub_unavailable`:

* offline mode (``HF_HUB_OFFLINE``; for datasets also ``HF_DATASETS_OFFLINE``) and the id is not in the
  local Hugging Face cache: unavailable at once;
* otherwise one TCP connection to the Hub endpoint (or to the HTTPS proxy, when one is set), at most
  :data:`PROBE_TIMEOUT_S`, its answer kept for the rest of the process: unreachable and the id not
  cached: unavailable. Unreachable but cached: models are loaded with ``local_files_only``.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import urllib.request
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

RepoType = Literal["model", "dataset"]
PROBE_TIMEOUT_S = 1.0
_TRUE = {"1", "ON", "YES", "TRUE"}


def offline(repo_type: RepoType) -> bool:
    """Offline mode as huggingface_hub (models) or datasets (datasets) reads it."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_DATASETS_OFFLINE") if repo_type == "dataset" else None
    return bool(constants.HF_HUB_OFFLINE) if flag is None else flag.upper() in _TRUE


def cached(repo_id: str, repo_type: RepoType) -> bool:
    """Whether some copy of ``repo_id`` is in the Hugging Face caches (hub files, or prepared datasets)."""
    from huggingface_hub import constants

    folders = [Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{repo_id.replace('/', '--')}"]
    if repo_type == "dataset":
        datasets_cache = os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets"
        folders.append(Path(datasets_cache) / repo_id.replace("/", "___"))
    return any(f.is_dir() for f in folders)


def _probe_address() -> tuple[str, int]:
    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(url.scheme or "https") or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(url.hostname or ""):
        url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    return url.hostname or "", url.port or (443 if url.scheme == "https" else 80)


@functools.cache
def _reachable(host: str, port: int) -> bool:
    answer: list[bool] = []

    def connect() -> None:  # in a thread, so that a slow name lookup is bounded too
        try:
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
            answer.append(True)
        except OSError:
            pass

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(PROBE_TIMEOUT_S)
    return bool(answer)


def hub_reachable() -> bool:
    """One TCP connection to the Hub (or its proxy) per process and address, at most PROBE_TIMEOUT_S."""
    return _reachable(*_probe_address())


def hub_unavailable(repo_id: str, repo_type: RepoType) -> str | None:
    """None when a download of ``repo_id`` may go ahead (or a cached copy serves it); else why not, as a
    phrase to put in an error message."""
    from huggingface_hub import constants

    if cached(repo_id, repo_type):
        return None
    if offline(repo_type):
        names = "HF_HUB_OFFLINE" + (" / HF_DATASETS_OFFLINE" if repo_type == "dataset" else "")
        return f"{names} is set and {repo_id!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if not hub_reachable():
        return f"the Hub ({constants.ENDPOINT}) cannot be reached from here and {repo_id!r} is not in the Hugging Face cache"
    return None
