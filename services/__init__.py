"""rlflow's long-lived services: rollout, reward, teacher and trainer.

Each is a trio program that runs one loop under a nursery and speaks only
the protocol.
"""
