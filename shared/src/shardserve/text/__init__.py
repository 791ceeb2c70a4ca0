"""Text for generation: tokenizing, chat templates, incremental detokenizing, stop strings."""
