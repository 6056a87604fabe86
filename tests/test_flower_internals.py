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
