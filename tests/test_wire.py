import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedpeft.algorithms import UpdateRejected, check_update
from fedpeft.wire import Payload, PayloadError, decode, encode


def test_roundtrip_and_exact_size():
    p = Payload({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1], dtype=np.int64)},
                {"round": 3, "num_examples": 10, "loss": 0.5})
    data = encode(p)
    q = decode(data)
    assert q.meta == p.meta
    assert set(q.arrays) == {"a", "b"}
    np.testing.assert_array_equal(q.arrays["a"], p.arrays["a"])
    assert q.arrays["b"].dtype == np.int64
    # 24 bytes of float32 + 8 of int64 + 8-byte length prefix + JSON header
    header_len = int.from_bytes(data[:8], "little")
    assert len(data) == 8 + header_len + 24 + 8


def test_no_pickle_on_the_wire():
    data = encode(Payload({"x": np.zeros(3, dtype=np.float32)}, {"round": 1}))
    assert b"\x80\x04" not in data[:2] and data[8:9] == b"{"  # a JSON header, not a pickle stream


@pytest.mark.parametrize("blob, message", [
    (b"", "too short"),
    (b"\xff" * 8 + b"{}", "header claims"),
    ((5).to_bytes(8, "little") + b"nojsn", "not valid JSON"),
    ((2).to_bytes(8, "little") + b"[]", "not a JSON object"),
    ((24).to_bytes(8, "little") + b'{"__metadata__": [1]}   ', "__metadata__ is not a JSON object"),
    ((5007).to_bytes(8, "little") + b'{"a": ' + b"9" * 5000 + b'}', "not valid JSON"),  # over Python's int limit
])
def test_malformed_bytes_raise_payload_error(blob, message):
    with pytest.raises(PayloadError, match=message):
        decode(blob)


def test_oversized_payload_rejected():
    data = encode(Payload({"x": np.zeros(1000, dtype=np.float32)}, {}))
    with pytest.raises(PayloadError, match="exceeds the limit"):
        decode(data, max_bytes=1000)


def test_non_json_metadata_rejected_at_encode():
    with pytest.raises(PayloadError):
        encode(Payload({}, {"loss": float("nan")}))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_the_decoder(blob):
    try:
        decode(blob)
    except PayloadError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_valid_payloads_decode_or_fail_cleanly(data):
    good = encode(Payload({"w": np.ones((4, 4), dtype=np.float32)}, {"round": 1, "num_examples": 3}))
    pos = data.draw(st.integers(0, len(good) - 1))
    byte = data.draw(st.integers(0, 255))
    mutated = good[:pos] + bytes([byte]) + good[pos + 1:]
    cut = data.draw(st.integers(0, len(mutated)))
    try:
        decode(mutated[:cut])
    except PayloadError:
        pass


EXPECTED = {"w": ((2, 2), "float32"), "b": ((2,), "float32")}


def _good(**meta):
    m = {"round": 2, "num_examples": 5, **meta}
    return Payload({"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}, m)


def test_check_update_accepts_a_good_update():
    check_update(_good(), EXPECTED, 2)


@pytest.mark.parametrize("mutate, reason", [
    (lambda p: p.arrays.update(extra=np.zeros(1, np.float32)), "unknown parameter 'extra'"),
    (lambda p: p.arrays.pop("b"), "missing parameter 'b'"),
    (lambda p: p.arrays.update(w=np.zeros((2, 3), np.float32)), "shape (2, 3) != expected (2, 2)"),
    (lambda p: p.arrays.update(w=np.zeros((2, 2), np.float64)), "dtype float64 != expected float32"),
    (lambda p: p.arrays.update(b=np.array([0, np.nan], np.float32)), "NaN or Inf"),
    (lambda p: p.arrays.update(b=np.array([np.inf, 0], np.float32)), "NaN or Inf"),
    (lambda p: p.meta.update(round=1), "stale or missing round number 1"),
    (lambda p: p.meta.pop("round"), "stale or missing round number None"),
    (lambda p: p.meta.update(num_examples=0), "num_examples must be a positive integer"),
    (lambda p: p.meta.update(num_examples="7"), "num_examples must be a positive integer"),
])
def test_check_update_rejects_with_a_reason(mutate, reason):
    p = _good()
    mutate(p)
    with pytest.raises(UpdateRejected) as err:
        check_update(p, EXPECTED, 2)
    assert reason in str(err.value)


def test_upload_size_does_not_depend_on_wall_time():
    from fedpeft.training.local import TrainResult
    from fedpeft.wire import clock_seconds

    def upload(seconds: float) -> bytes:
        result = TrainResult(loss=0.5, steps=3, examples=48, tokens=3072, seconds=seconds, flops=1.5e9,
                             flops_sampled_steps=1, ops_analytic=2.0e9)
        return encode(Payload({"w": np.zeros(3, dtype=np.float32)}, {"round": 1, **result.as_meta()}))

    sizes = {len(upload(s)) for s in (0.0, 0.001234, 9.5, 12.345678901, 86399.9)}
    assert len(sizes) == 1
    assert clock_seconds(decode(upload(12.345678901)).meta, "train_seconds") == pytest.approx(12.345679, abs=1e-6)
