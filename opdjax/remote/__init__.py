"""Engines in other processes: opdjax's HTTP server around a rollout engine or a teacher (`server`), vLLM's own
server extended for opdjax (`vllm_server`: a worker extension with the weight bridge, a token middleware), the
clients the pipeline uses instead of in-process engines (`client`, speaking to either), and the wire format
(`protocol`, a subset of the OpenAI completions API as vLLM serves it, plus the weight version of each response)."""
