"""Speculative decoding: the Drafter the runner calls after sampling (n-gram proposer, draft policy, the
verify-step cost measured at start-up); the runner verifies the drafts in the next step."""
