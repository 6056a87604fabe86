"""A long-lived ClientApp worker for one SuperNode: the model stays loaded between rounds.

Flower 1.41 runs every message in a fresh ``flwr-clientapp`` process: interpreter start, imports of
torch and transformers, model and data, each round (about 9 s of a 21 s round here, see
BENCHMARKS.md). Flower has no long-lived ClientApp (its warm executors serve only Kubernetes agent,
model and connector tasks, one task per process). This worker takes the SuperExec's place for one
SuperNode started with ``--isolation process``: it asks the SuperNode's Runtime API for ClientApp
tasks and runs each one in this process, the way ``flwr-clientapp`` does (pull message, context, run
and FAB; run the ClientApp; push the reply and the context) but without exiting afterwards. So
fedpeft's ClientApp keeps its experiment (model, tokenised data) in memory across messages.

    flower-supernode --isolation process --port 9094 ... &
    python -m fedpeft.runtime.flower.warm_worker --runtime-api-address 127.0.0.1:9094

It uses Flower's own task helpers (``flwr.supernode.runtime.run_clientapp``), which are internal
API: this module is written against flwr==1.41.0 (pinned). Apps are imported once per process, so
restart the worker after upgrading fedpeft. Only fedpeft's ClientApp is accepted.
"""

from __future__ import annotations

import argparse
import logging
import time

import psutil
from flwr.app import Error, Message

from fedpeft.runtime.flower.internals import (
    AcquireTaskRequest,
    ErrorCode,
    HeartbeatSender,
    RuntimeHttpClient,
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
    SubStatus,
    get_fab_config,
    get_load_client_app_fn,
    install_from_fab,
    make_simple_http_retry_invoker,
    make_task_heartbeat_fn_http,
    pull_task_input,
    push_message,
    push_task_output,
)

log = logging.getLogger("fedpeft")
CLIENTAPP_TASK = "flwr-clientapp"
ACCEPTED_APP = "fedpeft.runtime.flower.client_app"


def _client(address: str, interceptors: list) -> RuntimeHttpClient:
    return RuntimeHttpClient.from_server_address(server_address=address, insecure=True, root_certificates=None,
                                                 interceptors=interceptors,
                                                 retry_invoker=make_simple_http_retry_invoker())


def serve_one(address: str, token: str, load_app, installed: set[str]) -> None:
    """Run one ClientApp task in this process and report it to the SuperNode."""
    client = _client(address, [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                               RuntimeTokenHttpInterceptor(token)])
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message = context = reply = None
    status, details = SubStatus.FAILED, "the task failed before the ClientApp ran"
    try:
        message, context, run, fab = pull_task_input(client)
        component = get_fab_config(fab.content).get("tool", {}).get("flwr", {}).get("app", {}).get(
            "components", {}).get("clientapp")
        if component != f"{ACCEPTED_APP}:app":  # checked before any of the app's code is installed or imported
            raise RuntimeError(f"this worker runs only {ACCEPTED_APP}:app, not {component!r}")
        if fab.hash_str not in installed:
            install_from_fab(fab.content, skip_prompt=True)
            installed.add(fab.hash_str)
        app = load_app(run.fab_id, run.fab_version, fab.hash_str)
        if not _is_fedpeft(app):
            raise RuntimeError(f"this worker runs only {ACCEPTED_APP}:app")
        reply = app(message=message, context=context)
        status, details = SubStatus.COMPLETED, ""
    except Exception as exc:  # reported to the server as the client's error, like flwr-clientapp does
        details = f"{type(exc)}:<'{exc}'>"
        log.exception("ClientApp task failed")
        if message is not None:
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
            push_task_output(client, context, status, details)
        finally:
            heartbeat.stop()
            client.close()


def _is_fedpeft(app) -> bool:
    from fedpeft.runtime.flower import client_app

    return app is client_app.app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Long-lived fedpeft ClientApp worker for one SuperNode "
                                             "(started with --isolation process).")
    ap.add_argument("--runtime-api-address", default="127.0.0.1:9094",
                    help="the SuperNode's local Runtime API (its --host:--port)")
    ap.add_argument("--poll", type=float, default=0.05, help="seconds between task polls")
    ap.add_argument("--supernode-pid", type=int, help="exit when this process (the SuperNode) is gone")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from fedpeft.runtime.flower import client_app  # noqa: F401  (import torch & co. once, up front)

    acquire = _client(args.runtime_api_address, [RuntimeVersionHttpInterceptor(component_name="SuperExec")])
    load_app = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
    installed: set[str] = set()
    log.info("fedpeft ClientApp worker polling %s", args.runtime_api_address)
    while args.supernode_pid is None or psutil.pid_exists(args.supernode_pid):
        try:
            res = acquire.AcquireTask(AcquireTaskRequest(supported_task_types=[CLIENTAPP_TASK]))
            if res.HasField("task") and res.token:
                serve_one(args.runtime_api_address, res.token, load_app, installed)
                continue
        except Exception:  # the SuperNode restarting, a failed push: logged, and the worker keeps serving
            log.exception("ClientApp worker: task handling failed")
            time.sleep(1.0)
        time.sleep(args.poll)
    log.info("SuperNode %d is gone; worker exits", args.supernode_pid)


if __name__ == "__main__":
    main()
