"""The demo pair: the SmolLM2 target fetched through pip, and the draft shipped in `draft/`."""
