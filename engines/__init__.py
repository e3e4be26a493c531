"""The engines: the vLLM launcher (``kvloop engine``), kvloop's KV connector (:mod:`.connector`), the engine
sidecar (:mod:`.sidecar`), the tiny local model and the layout fingerprint. Imports only :mod:`kvloop.shared`."""
