"""Client-level differential privacy (``algorithm.dp``, DP-FedAvg): a wrapper around the halves of any algorithm
with a ``dp`` option.

:mod:`.options` holds its options, :mod:`.mean` the clipping, the noisy mean and the privacy accounting,
:mod:`.wrapper` the server wrapper (secret sampling, the clients' clipping checked, the noisy mean in place of the
weighted one, the privacy spent reported and checkpointed, the run stopped at its budget) and the client wrapper
(each update clipped before it is sent). Importing this package imports no torch and no Flower.
"""
