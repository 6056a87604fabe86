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
* error codes and statuses of messages and tasks (``server_app.py``, ``warm_worker.py``).
"""

from __future__ import annotations

from flwr.cli.install import install_from_fab
from flwr.clientapp.typing import ClientAppCallable
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.config import get_fab_config
from flwr.common.constant import ErrorCode, SubStatus
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.serde import recorddict_to_proto
from flwr.compat.common import recorddict_compat
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=no-name-in-module
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode import start_client_internal
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

FLOWER_VERSION = "1.41.0"  # the version every name here was checked against


def run_flower_supernode() -> None:
    """Flower's ``flower-supernode`` command (its arguments from ``sys.argv``)."""
    from flwr.supernode.cli.flower_supernode import flower_supernode

    flower_supernode()


__all__ = [
    "FLOWER_VERSION",
    "MAIN_CONFIGS_RECORD",
    "MAIN_PARAMS_RECORD",
    "RECORD_KEY_CONFIGS",
    "AcquireTaskRequest",
    "ClientAppCallable",
    "ErrorCode",
    "GridClientProxy",
    "HeartbeatSender",
    "Key",
    "LegacyContext",
    "RuntimeHttpClient",
    "RuntimeTokenHttpInterceptor",
    "RuntimeVersionHttpInterceptor",
    "Stage",
    "SubStatus",
    "WorkflowKey",
    "get_fab_config",
    "get_load_client_app_fn",
    "install_from_fab",
    "make_simple_http_retry_invoker",
    "make_task_heartbeat_fn_http",
    "pull_task_input",
    "push_message",
    "push_task_output",
    "recorddict_compat",
    "recorddict_to_proto",
    "run_flower_supernode",
    "start_client_internal",
]
