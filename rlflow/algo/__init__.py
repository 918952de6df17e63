"""The algorithm: advantage estimators, the policy loss with its off-policy
corrections, and the staleness rule (torch is imported only by `losses`)."""
