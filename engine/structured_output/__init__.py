"""Structured output.

Grammars (JSON schema, regex, choice, tool calls) compiled to token masks by llguidance, their
structural bounds, the sandbox that compiles a new grammar in a worker process first, and the core's
off-step compile manager (docs/structured_output.md).
"""
