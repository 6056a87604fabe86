"""The Flower runtime: fedpeft's server and client halves as a Flower ServerApp and ClientApp.

* :mod:`.records`: fedpeft wire payloads inside Flower messages (one uint8 ``Array`` per payload);
* :mod:`.server_app`: the ServerApp; it runs the same run and schedule as the embedded runtime
  (:class:`fedpeft.runtime.embedded.EmbeddedRuntime`) over :class:`.server_app.FlowerTransport`, which sends each
  selected client its own payload through the Grid and waits for replies up to ``federation.round_timeout_s``;
* :mod:`.client_app`: the ClientApp; it trains the fedpeft client ids of its SuperNode's partition
  (``--node-config "partition-id=I num-partitions=N"``: client c lives on partition c mod N);
* :mod:`.launch`: writes the Flower app for a config, starts a SuperLink and SuperNodes on loopback
  (or submits to a running SuperLink) and runs ``flwr run``;
* :mod:`.superlink`: ``flower-superlink`` whose Control and Runtime APIs answer only ``--control-from``, and
  which stops on SIGTERM with everything it started;
* :mod:`.superexec`: ``flower-superexec`` that waits for the ServerApp processes it starts;
* :mod:`.processes`: stopping and reaping the processes those launchers started;
* :mod:`.bounded_pull`: the ServerApp's reply pull within a byte budget per reply;
* :mod:`.partitions`: which SuperNode serves which partition, and who may take one over.

Algorithms plug in through :mod:`fedpeft.algorithms` only; nothing here knows a particular algorithm.
"""
