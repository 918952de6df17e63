"""The trainer process: the service that consumes groups within the staleness
bound, takes optimizer steps and publishes weights, and its engines
(simulated, torch)."""
