"""wire.encoded_size equals the length of wire.encode for any arrays and metadata, without the arrays."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fedpeft import wire

names = st.text(alphabet="abcXYZ._/é0123", min_size=1, max_size=30)
arrays = st.dictionaries(names, st.tuples(st.lists(st.integers(0, 40), max_size=3),
                                          st.sampled_from(["float32", "int32", "float16", "float64", "int64", "uint8"])),
                         max_size=8)
metas = st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                                                      st.text(max_size=12), st.none()), max_size=5)


@settings(max_examples=300, deadline=None)
@given(arrays, metas)
def test_encoded_size_is_the_length_of_the_encoding(spec, meta):
    payload = wire.Payload({k: np.zeros(shape, dtype=dtype) for k, (shape, dtype) in spec.items()}, meta)
    assert wire.encoded_size({k: (tuple(shape), dtype) for k, (shape, dtype) in spec.items()}, meta) == len(
        wire.encode(payload))
