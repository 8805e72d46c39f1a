"""The driver side of serving: streams of tokens from the groups, text from the tokens, and the
OpenAI-compatible HTTP front end on Ray Serve."""
