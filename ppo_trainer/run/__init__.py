"""A run on disk: its output folder, checkpoints, what a resume keeps, applies and refuses."""
