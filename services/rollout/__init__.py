"""The rollout process: the service that turns credits into prompt groups and
streams finished groups on, and its engines (simulated, vLLM)."""
