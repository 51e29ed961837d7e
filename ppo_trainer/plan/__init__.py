"""The dry run: the plan of a run (roles, placement, batch arithmetic) and its memory estimate."""
