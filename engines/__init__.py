"""Engine sidecars and the vLLM KV connector (issue: engines). Not built yet: the broker's protocol
in ``protos/kvloop/v1`` is what they will speak."""
