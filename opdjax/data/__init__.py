"""Data: built-in and JSONL tasks (`tasks`), prompt streams and padded batches (`prompts`), and the built-in
teacher/student pair (`prepare`)."""
