"""Data: built-in and JSONL tasks (`tasks`), prompt streams and padded batches (`prompts`). The built-in
teacher/student pair is trained in `opdjax.pipeline.prepare`."""
