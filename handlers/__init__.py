"""pt2-handlers: TorchServe handlers that make torch.compile safe to turn on in production.

The package's folders are its layers, lowest first (``LAYERS``); a module imports only from its own layer and those
below it (tests/test_import_graph.py holds every module to it):

    errors      typed errors, each carrying the HTTP status a client sees
    config/     the model YAML read and validated into frozen values: pt2 and pt2_handlers, the shape policy
    cpu/        the machine: CPU features, threads, cores shared between workers, the fused attention kernel
    precision/  the model in a precision: which precisions to try, float casts, int8 built and measured
    rungs/      the ways to run a model, one per rung: torch.compile (and its caches and checks), IPEX, eager
    ladder/     the load-time search over rungs and precisions, proven against fp32 eager; the guard on traffic
    models/     loading the model an archive carries
    tasks/      what each task does: parse, preprocess, the module to optimize, the gate, postprocess
    serving/    the engine (load, READY, batches in, answers out) and TorchServe's adapter, the only ``ts`` import

Importing this package does nothing else: no torch flags, no environment reads, no TorchServe import. The TorchServe
entry point is ``handlers.serving.torchserve_handler.Pt2Handler``; ``python -m handlers`` is the command line.
"""

__version__ = "0.1.0"

LAYERS = ("errors", "config", "cpu", "precision", "rungs", "ladder", "models", "tasks", "serving")
