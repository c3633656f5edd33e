"""Tool calling: tools shown to the model, its calls parsed out of its text, forced calls."""
