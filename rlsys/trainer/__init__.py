"""Trainer: advantages and losses (registries: advantages.py, losses.py), token-budget micro-batching
(batching.py), torch and DeepSpeed backends, and the Ray actors that run them (worker.py). Nothing is imported
here, so that `rlsys check` reads the registries without torch."""
