"""Fused LLM ops that are not single ATen ops (reached through their own API)."""
