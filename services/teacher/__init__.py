"""The teacher process: adds a frozen model's log-probabilities and passes the
batch on."""

# The config's root holds this role's tables (`config` here): it loads first, so that importing a module of
# this folder before the config finds the tables whole.
import rlflow.config  # noqa: F401
