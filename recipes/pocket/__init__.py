"""The bundled pocket target: its corpus, tokenizer, pretraining, recipes and follow-up experiments."""
