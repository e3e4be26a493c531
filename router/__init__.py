"""The KV-aware OpenAI-compatible router: the HTTP shell (:mod:`.server`) and one turn (:mod:`.turn`): tokenize,
place at the broker, pin, prefill with the pull, decode. Imports only :mod:`kvloop.shared`."""
