"""Flower's internal API as fedpeft uses it (fedpeft.runtime.flower.internals): these tests fail when a Flower
upgrade moves, renames or reshapes any of it, before a run does."""

from __future__ import annotations

import inspect

import flwr
import pytest

from fedpeft.runtime.flower import internals


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_written_for_the_pinned_flower():
    assert flwr.__version__ == internals.FLOWER_VERSION


@pytest.mark.parametrize("name", internals.__all__)
def test_every_internal_name_resolves(name):
    assert getattr(internals, name) is not None


def test_the_task_protocol_of_the_warm_worker_keeps_its_shape():
    assert len(_params(internals.pull_task_input)) == 1
    assert len(_params(internals.push_message)) == 3
    assert len(_params(internals.push_task_output)) == 4
    assert {"skip_prompt"} <= set(_params(internals.install_from_fab))
    assert {"server_address", "insecure", "root_certificates", "interceptors", "retry_invoker"} <= set(
        _params(internals.RuntimeHttpClient.from_server_address))
    assert {"default_app_ref", "app_path", "multi_app"} <= set(_params(internals.get_load_client_app_fn))
    assert "supported_task_types" in internals.AcquireTaskRequest.DESCRIPTOR.fields_by_name
    assert {"FAILED", "COMPLETED"} <= set(vars(internals.SubStatus))


def test_the_secure_aggregation_pieces_keep_their_shape():
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState

    assert _params(SecAggPlusWorkflow._check_threshold) == ["self", "state"]
    state = WorkflowState()
    assert all(hasattr(state, a) for a in ("active_node_ids", "sampled_node_ids", "nid_to_neighbours"))
    assert {"context", "config", "strategy"} <= set(_params(internals.LegacyContext))
    assert {"node_id", "grid", "run_id"} <= set(_params(internals.GridClientProxy))
    assert {"keep_input"} <= set(_params(internals.recorddict_compat.recorddict_to_fitins))
    assert {"keep_input"} <= set(_params(internals.recorddict_compat.fitres_to_recorddict))
    assert hasattr(internals.Key, "STAGE") and hasattr(internals.Stage, "COLLECT_MASKED_VECTORS")
    assert hasattr(internals.WorkflowKey, "CURRENT_ROUND")
    assert {"MESSAGE_UNAVAILABLE", "REPLY_MESSAGE_UNAVAILABLE"} <= set(vars(internals.ErrorCode))


def test_nothing_else_imports_flower_internals():
    """Outside internals.py, fedpeft imports only Flower's public API."""
    from conftest import REPO

    public = ("flwr.app", "flwr.serverapp", "flwr.clientapp", "flwr.common", "flwr.server", "flwr.server.strategy",
              "flwr.server.workflow", "flwr.client.mod")
    offenders = []
    for path in (REPO / "src" / "fedpeft").rglob("*.py"):
        if path.name == "internals.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            words = line.split()
            if (len(words) >= 2 and words[0] in ("from", "import") and words[1].startswith("flwr")
                    and words[1] not in public):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, offenders


def _superlink_cli():
    """The module of flower-superlink's entry point (its package exports a function of the same name)."""
    import importlib

    return importlib.import_module("flwr.superlink.cli.flower_superlink")


def test_the_superlink_app_can_still_be_wrapped_and_the_filter_sits_in_front_of_it(monkeypatch):
    """flower-superlink builds its FastAPI app by calling flwr.superlink.main.create_app, imported when it runs:
    wrap_superlink_app reaches it, and on Flower's real app the filter refuses an outsider's Control call while
    its Fleet and health paths reach Flower."""
    import asyncio

    import flwr.superlink.main as superlink_main
    import httpx

    from fedpeft.runtime.flower.superlink import ControlFromFilter, install, parse_control_from

    source = inspect.getsource(_superlink_cli()._run_superlink_http_api)
    assert "from flwr.superlink.main import" in source and "create_app(" in source
    monkeypatch.setattr(superlink_main, "create_app", superlink_main.create_app)  # restored afterwards
    install(parse_control_from(["127.0.0.1/32"]))
    app = superlink_main.create_app()
    assert app.user_middleware[0].cls is ControlFromFilter

    async def status(peer: str, method: str, path: str) -> int:
        transport = httpx.ASGITransport(app=app, client=(peer, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://superlink") as client:
            return (await client.request(method, path, headers={"content-type": "application/protobuf"})).status_code

    assert asyncio.run(status("10.1.1.1", "POST", "/v1/control/list-nodes")) == 403
    assert asyncio.run(status("10.1.1.1", "POST", "/v1/runtime/acquire-task")) == 403
    assert asyncio.run(status("10.1.1.1", "GET", "/health")) == 200
    assert asyncio.run(status("10.1.1.1", "POST", "/v1/fleet/pull-messages")) not in (403, 404)  # Flower's answer
    assert asyncio.run(status("127.0.0.1", "POST", "/v1/control/list-nodes")) != 403


def test_the_public_paths_are_the_fleet_api_a_supernode_calls_and_health():
    import re

    from flwr.supernode import fleet_http_client

    public = internals.superlink_public_paths()
    assert all(p.startswith("/v1/fleet/") or p == "/health" for p in public)
    called = set(re.findall(r'path="(/v1/[^"]+)"', inspect.getsource(fleet_http_client)))
    assert len(called) >= 10 and called <= public


def test_the_grpc_control_api_switch_keeps_its_name():
    assert internals.GRPC_CONTROL_API_ENV == "FLWR_INTERNAL_GRPC_CONTROL_API"
    assert "os.getenv(FLWR_INTERNAL_GRPC_CONTROL_API) == \"1\"" in inspect.getsource(_superlink_cli())


@pytest.mark.parametrize(("host", "dialled"), [("::", "[::1]"), ("0.0.0.0", "127.0.0.1"), ("10.0.0.1", "10.0.0.1")])
def test_the_superexec_command_can_still_be_wrapped_and_says_where_it_dials(monkeypatch, host, dialled):
    """flower-superlink (--isolation subprocess) builds its SuperExec's command with the module function
    _get_superexec_command, called with the Runtime API address the SuperExec dials: a bind-all --host becomes
    loopback of its family. wrap_superexec_command reaches it; the command is what Popen starts."""
    from types import SimpleNamespace

    cli = _superlink_cli()
    monkeypatch.setattr(cli, "_get_superexec_command", cli._get_superexec_command)  # restored afterwards
    seen, started = [], []
    internals.wrap_superexec_command(lambda command, address: seen.append((command, address)) or ["wrapped"])
    monkeypatch.setattr(cli.subprocess, "Popen", lambda command, **kwargs: started.append(command))
    config = SimpleNamespace(isolation="subprocess", host=host, port=9093, certificates=None, ssl_ca_certfile=None,
                             runtime_dependency_install=False)
    cli.SuperLinkLifespan._start_superexec_if_needed(SimpleNamespace(config=config, superexec_process=None))
    ((command, address),) = seen
    assert address == f"{dialled}:9093" and command[0] == "flower-superexec"
    assert command[command.index("--runtime-api-address") + 1] == address
    assert started == [["wrapped"]]


def test_the_superlink_serves_through_uvicorn_run_and_its_shutdown_can_be_bounded(monkeypatch):
    """flower-superlink serves with uvicorn.run(...) (its module's uvicorn), without a graceful-shutdown timeout:
    uvicorn then waits for every open request when it stops. bound_superlink_shutdown gives it one."""
    import uvicorn

    cli = _superlink_cli()
    source = inspect.getsource(cli._run_superlink_http_api)
    assert "uvicorn.run(" in source and "timeout_graceful_shutdown" not in source
    assert "timeout_graceful_shutdown" in _params(uvicorn.run)
    monkeypatch.setattr(cli, "uvicorn", cli.uvicorn)  # restored afterwards
    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: calls.append(kwargs))
    internals.bound_superlink_shutdown(3.0)
    internals.bound_superlink_shutdown(2.0)  # again: replaces the bound, does not stack
    cli.uvicorn.run(app=None, host="127.0.0.1")
    assert calls == [{"app": None, "host": "127.0.0.1", "timeout_graceful_shutdown": 2.0}]
    assert cli.uvicorn.Config is uvicorn.Config


def test_the_superexec_drops_the_handles_of_the_processes_it_starts():
    """Why fedpeft.runtime.flower.superexec exists: Flower's SubprocessExecutor starts a ServerApp with Popen and keeps
    no handle (so CPython keeps it in subprocess._active until the next Popen), and its loop has no wait."""
    import subprocess

    from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

    source = inspect.getsource(SubprocessExecutor.launch)
    assert "subprocess.Popen(" in source and "= subprocess.Popen(" not in source
    assert "wait" not in inspect.getsource(SubprocessExecutor.reconcile)
    assert callable(subprocess._cleanup) and isinstance(subprocess._active, list)
    assert _params(internals.run_flower_superexec) == []


def test_the_bounded_pull_finds_what_it_reads_where_it_reads_it():
    """HttpGrid's address / TLS / token fields, the Runtime client's HTTP client, the protobuf field numbers
    bounded_pull reads as streams, the object format and the Array header."""
    import httpx
    import numpy as np
    from flwr.app import Array
    from flwr.proto.message_pb2 import PullObjectResponse
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    from fedpeft.runtime.flower import bounded_pull as bp

    grid = internals.HttpGrid("127.0.0.1:9", insecure=True, token="t")
    assert {"_addr", "_insecure", "_cert", "_token", "_run"} <= set(vars(grid))
    client = internals.runtime_client_for(grid, [])
    assert isinstance(internals.http_client_of(client), httpx.Client)
    assert {"PullMessages", "PullObject", "ConfirmMessageReceived"} <= set(dir(client))

    def fields(proto) -> dict[str, tuple[int, int]]:
        return {f.name: (f.number, f.type) for f in proto.DESCRIPTOR.fields}

    message, bytes_type, bool_type = 11, 12, 8  # FieldDescriptor.TYPE_*
    assert fields(internals.PullAppMessagesResponse) == {"messages_list": (bp.MESSAGES_FIELD, message),
                                                        "message_object_trees": (bp.TREES_FIELD, message)}
    assert fields(PullObjectResponse) == {"object_found": (bp.FOUND_FIELD, bool_type),
                                          "object_available": (bp.AVAILABLE_FIELD, bool_type),
                                          "object_content": (bp.CONTENT_FIELD, bytes_type)}
    data = np.arange(3 * 5, dtype=np.float32).tobytes()
    array = Array(dtype="float32", shape=(3, 5), stype="numpy.ndarray", data=data)
    header = internals.read_array_header(array.deflate())
    assert (header.dtype, header.shape) == ("float32", (3, 5)) and list(header.chunk_ids) == list(array.children)
    chunks = {oid: obj.deflate() for oid, obj in get_all_nested_objects(array).items() if oid != array.object_id}
    assert sum(internals.object_body_size(chunks[c]) for c in header.chunk_ids) == len(data)
    assert internals.get_object_head_values_from_object_content(array.deflate())[0] == "Array"
