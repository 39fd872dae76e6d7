"""Prompts and settings shared by the speculative-decoding tests."""
from __future__ import annotations

from deepinfer_core import SamplingParams

PROMPTS = ["HAMLET.\nTo be, or not to be,", "KING.\nMy lord, the", "ROMEO.\nBut soft, what light",
           "First Citizen.\nWhat say you to", "Enter a Messenger.\n\nMESSENGER.\n", "QUEEN.\nAlas, my lord,",
           "ACT II.\n\nScene I.", "DUKE.\nGood morrow, gentle", "LADY.\nI pray you, sir,", "FOOL.\nNuncle,",
           "OTHELLO.\nIt is the cause,", "PORTIA.\nThe quality of mercy"]
TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
OPTIONS = dict(dtype="float32", device="cpu", batch_invariant=True, max_model_len=256)
