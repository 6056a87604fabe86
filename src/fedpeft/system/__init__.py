"""The simulated system: the clients' devices, links and availability (``system`` in the config) and the virtual
clock that turns a round's counted bytes and FLOPs into simulated seconds, independent of the host."""
