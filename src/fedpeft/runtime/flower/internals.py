"""Every piece of Flower's internal (non-public) API that fedpeft uses, in one place.

Flower's public API (``flwr.app``, ``flwr.serverapp``, ``flwr.clientapp``, the legacy ``flwr.common`` /
``flwr.server`` / ``flwr.client.mod`` names) is imported where it is used. What is imported here is not
promised by Flower to stay: it is written against the pinned flwr==1.41.0, and
``tests/test_flower_internals.py`` fails when an upgrade moves, renames or reshapes any of it. Nothing
else in fedpeft imports these modules directly.

Who uses what:

* the SuperNode launcher (``fast_supernode.py``): the module of Flower's SuperNode loop, whose ``time``
  it replaces to cap the loop's fixed sleeps;
* the warm ClientApp worker (``warm_worker.py``): the task protocol between a SuperNode and its
  ClientApp process (pull the task, push the reply, heartbeats, runtime API client and interceptors),
  FAB installation and app loading;
* SecAgg+ (``secure.py``, ``client_app.py``): the legacy workflow's context, client proxy, record
  keys and the message converters between records and legacy Fit messages; ``secure.py`` also
  overrides ``SecAggPlusWorkflow._check_threshold`` (a private method of a public class), checked by the
  same test;
* error codes and statuses of messages and tasks (``server_app.py``, ``warm_worker.py``);
* the SuperLink launcher (``superlink.py``): the point where ``flower-superlink`` builds its FastAPI
  app (:func:`wrap_superlink_app`), the paths of its Fleet API and health check, the environment
  switch of its extra gRPC Control API, the command it starts its SuperExec with
  (:func:`wrap_superexec_command`) and its ``uvicorn.run`` call (:func:`bound_superlink_shutdown`);
* the SuperExec launcher (``superexec.py``): Flower's ``flower-superexec`` entry point;
* the bounded reply pull (``bounded_pull.py``): the address, TLS and token of the ServerApp's
  ``HttpGrid`` (:func:`runtime_client_for`), the Runtime API's message and object requests, the
  object format (head, body, children) and the ``Array`` header (:func:`read_array_header`).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from flwr.cli.install import install_from_fab
from flwr.clientapp.typing import ClientAppCallable
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.config import get_fab_config
from flwr.common.constant import FLWR_INTERNAL_GRPC_CONTROL_API, ErrorCode, SubStatus
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.serde import recorddict_to_proto
from flwr.compat.common import recorddict_compat
from flwr.proto.message_pb2 import (  # pylint: disable=no-name-in-module
    ConfirmMessageReceivedRequest,
    ObjectTree,
    PullObjectRequest,
)
from flwr.proto.message_pb2 import Message as MessageProto  # pylint: disable=no-name-in-module
from flwr.proto.runtime_pb2 import (  # pylint: disable=no-name-in-module
    AcquireTaskRequest,
    PullAppMessagesRequest,
    PullAppMessagesResponse,
)
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.supercore.constant import HEAD_BODY_DIVIDER
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.inflatable.inflatable_object import get_object_head_values_from_object_content
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.protobuf.client import ProtobufRequestContext
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.superlink.grid import HttpGrid
from flwr.supernode import start_client_internal
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

FLOWER_VERSION = "1.41.0"  # the version every name here was checked against


def run_flower_supernode() -> None:
    """Flower's ``flower-supernode`` command (its arguments from ``sys.argv``)."""
    from flwr.supernode.cli.flower_supernode import flower_supernode

    flower_supernode()


# -- the SuperLink ----------------------------------------------------------------------------------

# set to "1", flower-superlink also serves the Control API over gRPC, outside its FastAPI app
GRPC_CONTROL_API_ENV = FLWR_INTERNAL_GRPC_CONTROL_API


def run_flower_superlink() -> None:
    """Flower's ``flower-superlink`` command (its arguments from ``sys.argv``)."""
    from flwr.superlink.cli.flower_superlink import flower_superlink

    flower_superlink()


def _superlink_cli() -> Any:
    """The module of flower-superlink's entry point (its package exports a function of the same name)."""
    return importlib.import_module("flwr.superlink.cli.flower_superlink")


def wrap_superexec_command(wrap: Callable[[list[str], str], list[str]]) -> None:
    """Make ``flower-superlink`` (in this process) start its SuperExec with ``wrap(command, runtime_address)`` in place
    of Flower's ``command`` (``["flower-superexec", ...]``). ``runtime_address`` is the Runtime API address the
    SuperExec, and every ServerApp it starts, connects to: ``--host:--port`` with a bind-all host (0.0.0.0, ::)
    replaced by loopback of its family (127.0.0.1, ::1), Flower's ``resolve_bind_address``.

    With ``--isolation subprocess`` (the default) ``SuperLinkLifespan._start_superexec_if_needed`` calls the module
    function ``_get_superexec_command`` (keyword ``runtime_address``) at the app's startup, looked up when called,
    so replacing that module attribute reaches it; with ``--isolation process`` it starts no SuperExec."""
    cli = _superlink_cli()
    original = cli._get_superexec_command

    def command(*args: Any, **kwargs: Any) -> list[str]:
        address = kwargs["runtime_address"] if "runtime_address" in kwargs else args[0]
        return wrap(list(original(*args, **kwargs)), address)

    cli._get_superexec_command = command


class _BoundedUvicorn:
    """The ``uvicorn`` module as ``flower-superlink`` sees it, except that ``run`` waits at most ``seconds`` for
    open connections when the server stops."""

    def __init__(self, module: Any, seconds: float) -> None:
        self._module, self._seconds = module, seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("timeout_graceful_shutdown", self._seconds)
        return self._module.run(*args, **kwargs)


def bound_superlink_shutdown(seconds: float) -> None:
    """Make ``flower-superlink`` (in this process) wait at most ``seconds`` for open requests when it stops.

    ``_run_superlink_http_api`` serves with ``uvicorn.run(...)`` (the ``uvicorn`` module global) and no
    ``timeout_graceful_shutdown``, so on SIGTERM or SIGINT uvicorn waits, without limit, for every open connection to
    end, and a ``flwr run --stream`` log stream lasts as long as its run; only a second SIGINT cuts it short."""
    cli = _superlink_cli()
    module = cli.uvicorn._module if isinstance(cli.uvicorn, _BoundedUvicorn) else cli.uvicorn
    cli.uvicorn = _BoundedUvicorn(module, seconds)


def run_flower_superexec() -> None:
    """Flower's ``flower-superexec`` command (its arguments from ``sys.argv``)."""
    from flwr.supercore.cli import flower_superexec

    flower_superexec()


def wrap_superlink_app(wrap: Callable[[Any], None]) -> None:
    """Make ``flower-superlink`` (in this process) call ``wrap(app)`` on its FastAPI app before serving it.

    ``flwr.superlink.cli.flower_superlink._run_superlink_http_api`` imports ``create_app`` from
    ``flwr.superlink.main`` when it is called, so replacing that module attribute reaches it."""
    import flwr.superlink.main as superlink_main

    original = superlink_main.create_app

    def create_app(*args: Any, **kwargs: Any) -> Any:
        app = original(*args, **kwargs)
        wrap(app)
        return app

    superlink_main.create_app = create_app


def superlink_public_paths() -> frozenset[str]:
    """The paths of the SuperLink's Fleet API (what a SuperNode calls) and of its health check."""
    from flwr.supercore.routers.health import router as health_router
    from flwr.superlink.routers.fleet.router import router as fleet_router

    return frozenset(route.path for router in (fleet_router, health_router) for route in router.routes)


# -- the ServerApp's replies --------------------------------------------------------------------------


def runtime_client_for(grid: HttpGrid, interceptors: Sequence[Any]) -> RuntimeHttpClient:
    """A Runtime API client like ``grid``'s own (address, TLS, the ServerApp's token, Flower's version and
    token headers, Flower's retries), with ``interceptors`` innermost (nearest the HTTP transport)."""
    return RuntimeHttpClient.from_server_address(
        server_address=grid._addr, insecure=grid._insecure, root_certificates=grid._cert,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-serverapp"),
                      RuntimeTokenHttpInterceptor(token=grid._token), *interceptors],
        retry_invoker=make_simple_http_retry_invoker())


def http_client_of(client: RuntimeHttpClient) -> httpx.Client:
    """The HTTP client (connection pool, TLS settings, timeouts) a Runtime API client sends with."""
    return client._client


def grid_run_id(grid: HttpGrid) -> int:
    return grid._run.run_id  # type: ignore[union-attr]


def object_body_size(content: bytes) -> int:
    """The length of an object's body (what follows its head)."""
    return len(content) - content.index(HEAD_BODY_DIVIDER) - len(HEAD_BODY_DIVIDER)


@dataclass(frozen=True)
class ArrayHeader:
    """What an ``Array`` object holds besides its chunks: dtype, shape, and the chunk id at each position."""

    dtype: str
    shape: tuple[int, ...]
    chunk_ids: tuple[str, ...]


def read_array_header(content: bytes) -> ArrayHeader:
    """The header of a deflated ``flwr.app.Array`` (``Array.deflate``: a JSON body with dtype, shape and
    ``arraychunk_ids``, indices into the object's children). ValueError if it is not one."""
    kind, children, _ = get_object_head_values_from_object_content(content)
    if kind != "Array":
        raise ValueError(f"an object of type {kind[:40]!r}, not Array")
    body = content[content.index(HEAD_BODY_DIVIDER) + len(HEAD_BODY_DIVIDER):]
    meta = json.loads(body.decode("utf-8"))
    try:
        dtype, shape, positions = meta["dtype"], meta["shape"], meta["arraychunk_ids"]
    except (KeyError, TypeError):
        raise ValueError("no dtype, shape or arraychunk_ids") from None
    if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(positions, list):
        raise ValueError("dtype, shape or arraychunk_ids of the wrong type")  # noqa: TRY004 (one error type)
    if not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError("a dimension that is not a non-negative integer")
    if not all(type(i) is int and 0 <= i < len(children) for i in positions):
        raise ValueError("a chunk position outside the object's children")
    return ArrayHeader(dtype, tuple(shape), tuple(children[i] for i in positions))


__all__ = [
    "FLOWER_VERSION",
    "GRPC_CONTROL_API_ENV",
    "MAIN_CONFIGS_RECORD",
    "MAIN_PARAMS_RECORD",
    "RECORD_KEY_CONFIGS",
    "AcquireTaskRequest",
    "ArrayHeader",
    "ClientAppCallable",
    "ConfirmMessageReceivedRequest",
    "ErrorCode",
    "GridClientProxy",
    "HeartbeatSender",
    "HttpGrid",
    "Key",
    "LegacyContext",
    "MessageProto",
    "ObjectTree",
    "ProtobufRequestContext",
    "PullAppMessagesRequest",
    "PullAppMessagesResponse",
    "PullObjectRequest",
    "RuntimeHttpClient",
    "RuntimeTokenHttpInterceptor",
    "RuntimeVersionHttpInterceptor",
    "Stage",
    "SubStatus",
    "WorkflowKey",
    "bound_superlink_shutdown",
    "get_fab_config",
    "get_load_client_app_fn",
    "get_object_head_values_from_object_content",
    "grid_run_id",
    "http_client_of",
    "inflate_object_from_contents",
    "install_from_fab",
    "make_simple_http_retry_invoker",
    "make_task_heartbeat_fn_http",
    "object_body_size",
    "pull_task_input",
    "push_message",
    "push_task_output",
    "read_array_header",
    "recorddict_compat",
    "recorddict_to_proto",
    "run_flower_superexec",
    "run_flower_superlink",
    "run_flower_supernode",
    "runtime_client_for",
    "start_client_internal",
    "superlink_public_paths",
    "wrap_superexec_command",
    "wrap_superlink_app",
]
