"""fedpeft payloads inside Flower messages.

A payload travels as the exact bytes of :func:`fedpeft.wire.encode` (safetensors, no pickle) in one
``flwr.app.Array`` of dtype uint8 with stype ``fedpeft.wire``, so the bytes counted are the bytes
sent and the receiver decodes and checks them exactly as the embedded runtime does. Flower sends
large arrays in chunks, so payload size is not limited by a message size cap.
"""

from __future__ import annotations

import yaml
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedpeft.config import RunConfig
from fedpeft.config.load import validate_config
from fedpeft.wire import PayloadError, check_size

WIRE_STYPE = "fedpeft.wire"
PAYLOAD_KEY = "payload"
INFO_KEY = "fedpeft"
CONFIG_KEY = "fedpeft-config"  # run config entry holding the resolved fedpeft config (YAML text)
# secure aggregation rounds travel as Flower's legacy FitIns / FitRes (what the SecAgg+ workflow and mod use)
SECURE_FIT_KEY = "fitins.parameters"  # FitIns array record: the fedpeft payload bytes as one uint8 array
ARRAY_NAMES_KEY = "fedpeft-arrays"  # FitIns config entry: names of the update's arrays, in the order sent
META_KEY = "fedpeft-meta"  # FitRes metrics entry: the update's fedpeft metadata (JSON)


def pack(data: bytes, **info: float | str | bool) -> RecordDict:
    array = Array(dtype="uint8", shape=(len(data),), stype=WIRE_STYPE, data=bytes(data))
    return RecordDict({PAYLOAD_KEY: ArrayRecord({PAYLOAD_KEY: array}), INFO_KEY: ConfigRecord(dict(info))})


def unpack(content: RecordDict, max_bytes: int | None = None) -> tuple[bytes, dict]:
    """(payload bytes, info); PayloadError if the message does not hold one fedpeft payload, or one of more than
    ``max_bytes`` bytes (checked on the array's declared shape, before its data is touched)."""
    try:
        record = content.array_records[PAYLOAD_KEY]
        info = dict(content.config_records.get(INFO_KEY, ConfigRecord()))
    except KeyError:
        raise PayloadError(f"message has no {PAYLOAD_KEY!r} array record") from None
    if list(record.keys()) != [PAYLOAD_KEY]:
        raise PayloadError(f"payload record must hold exactly one array named {PAYLOAD_KEY!r}")
    array = record[PAYLOAD_KEY]
    if array.stype != WIRE_STYPE or array.dtype != "uint8":
        raise PayloadError(f"payload array has stype {array.stype!r} / dtype {array.dtype!r}, "
                           f"expected {WIRE_STYPE!r} / 'uint8'")
    shape = tuple(array.shape)
    if len(shape) != 1 or not isinstance(shape[0], int):
        raise PayloadError(f"payload array has shape {shape}, expected one dimension of bytes")
    check_size(shape[0], max_bytes)
    data = array.data
    if not isinstance(data, bytes) or len(data) != shape[0]:
        raise PayloadError(f"payload array holds {len(data) if isinstance(data, bytes) else '?'} bytes, its shape "
                           f"says {shape[0]}")
    return data, info


def config_from_run_config(run_config: dict) -> RunConfig:
    text = run_config.get(CONFIG_KEY)
    if not isinstance(text, str):
        raise ValueError(f"the Flower run config lacks {CONFIG_KEY!r}; start runs with `fedpeft run` or an app "  # noqa: TRY004
                         "written by fedpeft.runtime.flower.launch.write_app")
    # the run's own processes: the config was run by the operator (fedpeft run), its plugins with it
    return validate_config(yaml.safe_load(text) or {}, trust_plugins=True)
