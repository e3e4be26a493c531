"""kvloop: closes the KV-cache loop in prefill/decode disaggregated vLLM serving.

The package has three floors (``docs/architecture.md``; ``tests/unit/test_floors.py`` guards them):

- bottom, :mod:`kvloop.shared` and the generated :mod:`kvloop.v1` stubs: errors, block keys, config, TLS,
  telemetry, the gRPC/HTTP server set-up, the broker client, the engine protocol. They import no service.
- services, :mod:`kvloop.broker`, :mod:`kvloop.engines`, :mod:`kvloop.router` (the repository's top-level
  ``broker/``, ``engines/`` and ``router/`` folders, linked into this package): each imports only the bottom floor.
- top, :mod:`kvloop.app`, the composition root: the CLI, the local cluster, the demo, the engine set, the
  benchmarks and ``kvloop analyze``. Nothing below imports it.

Importing ``kvloop`` starts and imports nothing (vLLM imports the engines' connector in every process).
"""
