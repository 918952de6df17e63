"""rlflow: asynchronous, disaggregated RL post-training for language models.

Its roles (`rlflow.roles`: rollout, reward, trainer and the optional ones) run
as long-lived services on Ray resource pools and stream msgspec-encoded samples to each other over
ZeroMQ; a trio controller places them, keeps the policy-version clock,
bounds staleness with credits and coordinates weight broadcasts.
"""

__version__ = "0.1.0"
