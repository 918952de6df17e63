"""The control plane: the controller (credits, the version clock, weight
rounds), its ledger of prompt groups and its run statistics, and the launcher
that places the services on Ray. It carries no sample data and never imports
torch or vLLM."""
