"""Node agents and the engines they run (real launchers and the simulated engine)."""
