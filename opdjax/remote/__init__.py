"""Engines in other processes: an HTTP server around a rollout engine or a teacher (`server`), the clients the
pipeline uses instead of in-process engines (`client`), and the wire format both speak (`protocol`, a subset of
the OpenAI completions API as vLLM serves it, plus the weight version of each response)."""
