"""Speculative decoding: draft-token proposers (the runner verifies their drafts in the next step)."""
