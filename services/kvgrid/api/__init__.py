"""Wire contract (generated code)."""
