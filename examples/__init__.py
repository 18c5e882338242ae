"""Example user packages (see docs/custom_agent.md); not part of the sluice library."""
