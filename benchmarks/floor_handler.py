"""A TorchServe handler that answers at once, without a model: what TorchServe itself takes for a lone request (its
frontend, its batching window, the socket to the worker and the worker's protocol code).

benchmarks/overhead.py serves it beside the model's archive in the same TorchServe, once with the model YAML's
batching and once with ``batchSize: 1``, so TorchServe's share of a lone request is measured against its own floor,
and the floor's batching window (how long a lone request waits for a batch to fill) is measured on its own.
"""

ANSWER = b'{"embedding": []}'


def handle(data, context):
    if data is None:  # TorchServe's call at load time
        return None
    return [ANSWER] * len(data)
