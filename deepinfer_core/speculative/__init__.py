"""Speculative decoding (issue 17): drafters and the verify loop. Verification itself is
`deepinfer_core.ops.verify`; state rollback is `SequenceState.rollback`."""
