"""What running costs on this machine, measured before a suite runs: `estimate` (a suite's
device-hours, from a round or two of each cost shape on fake data) and `bench` (the engine's
throughput: executors, caches, evaluation). What a run costs while it runs (its peak memory,
its first round's FLOPs) is measured by the engine itself, `fpbench.engine.cost`."""
