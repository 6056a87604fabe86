"""fedpeft's SuperNode launcher patches one thing in Flower: the sleeps of the SuperNode loop. These
tests fail when Flower changes what the patch relies on (the Flower tests run through the launcher)."""

import inspect

import flwr
from flwr.supernode import start_client_internal

from fedpeft.runtime.flower import fast_supernode
from fedpeft.runtime.flower.fast_supernode import ShortSleepClock


def test_written_for_the_pinned_flower_and_its_fixed_sleeps():
    assert flwr.__version__ == "1.41.0"
    source = inspect.getsource(start_client_internal)
    assert "import time\n" in source and "time.sleep(3)" in source and "time.sleep(0.5)" in source


def test_sleeps_are_capped_and_the_rest_of_time_is_untouched():
    slept = []
    fake = type("FakeTime", (), {"sleep": staticmethod(slept.append), "monotonic": staticmethod(lambda: 42.0)})
    clock = ShortSleepClock(0.05, fake)  # type: ignore[arg-type]
    clock.sleep(3)
    clock.sleep(0.5)
    clock.sleep(0.01)
    assert slept == [0.05, 0.05, 0.01] and clock.monotonic() == 42.0


def test_patch_replaces_the_loop_clock(monkeypatch):
    monkeypatch.setattr(start_client_internal, "time", start_client_internal.time)  # restored afterwards
    fast_supernode.patch(0.1)
    assert isinstance(start_client_internal.time, ShortSleepClock) and start_client_internal.time.cap_s == 0.1
