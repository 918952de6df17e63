"""The reward process: scores every response of a batch and passes it on."""
