"""The top floor, the composition root: the CLI, the local cluster, the demo, the engine set, the benchmarks and
``kvloop analyze``. It may import every service; nothing below it imports it (tests/unit/test_floors.py)."""
