"""Tools agents call: the Tool protocol and the built-in tools."""
