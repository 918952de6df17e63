"""Rewards that run untrusted code: the sandbox that runs a generated program
against its tests, killably and without network (stdlib only)."""
