"""Structured output: a request's StructuredOutput (shardlib/structured_output.py) compiled into an
llguidance grammar (grammars.py), matched token by token on the group's leader (matchers.py), and
turned into each step's allowed tokens (token_masks.py)."""
