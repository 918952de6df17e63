"""The data plane: trio-native ZeroMQ sockets that speak the protocol, and the
tasks that turn a group id into a prompt and score its answers."""
