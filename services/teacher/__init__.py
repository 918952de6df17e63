"""The teacher process: adds a frozen model's log-probabilities and passes the
batch on."""
