"""The serving core (the engine: load, READY, batches in, answers out) and its TorchServe edge."""
