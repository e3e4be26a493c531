"""The KV-aware OpenAI-compatible router (issue: router). Not built yet."""
