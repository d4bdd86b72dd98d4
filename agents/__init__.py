"""Node agents and the engines they run (real launchers and the simulated engine)."""

from xds import message_validation

# The agent protocol is betterproto2 too: same validator cache as the xDS messages.
message_validation.install()
