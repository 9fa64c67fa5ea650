"""The machine a worker runs on: its CPU's features, threads, the cores workers share, the fused attention kernel."""
