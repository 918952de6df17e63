"""The critic process: a learned value function that attaches GAE advantages
and returns to each batch on its way to the trainer, then trains on it."""
