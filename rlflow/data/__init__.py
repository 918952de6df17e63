"""The data plane: trio-native ZeroMQ sockets that speak the protocol, the
addresses and keys they use, and shared memory for large tensors. It imports
the protocol and nothing else of rlflow's."""
