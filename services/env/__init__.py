"""The env service: the run's environment and tools on a pool of their own,
asked by the rollout for each step of each episode."""
