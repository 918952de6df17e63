"""The critic process: a learned value function that attaches GAE advantages
and returns to each batch on its way to the trainer, then trains on it."""

# The config's root holds this role's tables (`config` here): it loads first, so that importing a module of
# this folder before the config finds the tables whole.
import rlflow.config  # noqa: F401
